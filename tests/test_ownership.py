"""zero_bnb deletes only what it can prove it wrote: an engine save into a tag folder that is not a zero_bnb
checkpoint holding only its own files (issue 31, F1)."""

from __future__ import annotations

import pytest
import torch
from ownership_scenarios import DOCUMENTS, saves_over_foreign_folders

from zero_bnb.format.ownership import checkpoint_strangers
from zero_bnb.testing.launch import run_distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ownership")
    run_distributed(saves_over_foreign_folders, 2, str(workdir))
    return torch.load(workdir / "ownership.pt", weights_only=False)


def test_a_save_into_a_users_folder_is_refused_and_deletes_nothing(runs):
    # It deleted the whole folder (6 files).
    assert runs["documents_after"] == DOCUMENTS
    message = runs["documents_error"]
    assert message.startswith("CheckpointSaveError") and "Documents exists and is not a checkpoint folder (it holds a.md, b.md, c.md, notes.txt, photos/cat.jpg " in \
        message and "Nothing was written. Save under another tag, or move" in message, message


def test_a_stock_checkpoint_at_the_tag_is_kept_whole_beside_the_new_one(runs):
    # A stock DeepSpeed tag folder lost a user's extra file (my_eval.json).
    assert len(runs["stock_kept"]) == 1 and runs["stock_kept_intact"], runs["stock_kept"]
    assert runs["stock_is_zero_bnb"]


def test_a_zero_bnb_checkpoint_is_replaced_and_one_with_a_users_file_is_kept(runs):
    assert runs["mine_kept"] == []
    assert len(runs["mine_with_user_file_kept"]) == 1 and runs["user_file_survives"]
    assert runs["loaded"]


def test_strangers_are_named_by_path(tmp_path):
    assert checkpoint_strangers(str(tmp_path)) == []
    (tmp_path / "zero_bnb").mkdir()
    (tmp_path / "zero_bnb" / "x.pt").write_bytes(b"1")
    (tmp_path / "y").symlink_to("zero_bnb")
    assert checkpoint_strangers(str(tmp_path)) == ["y", "zero_bnb/x.pt"]  # no manifest: every entry
