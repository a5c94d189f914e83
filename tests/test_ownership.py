"""zero_bnb deletes only what it can prove it wrote: an engine save into a tag folder that is not a zero_bnb
checkpoint holding only its own files (issue 31, F1)."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from ownership_scenarios import DOCUMENTS, saves_over_foreign_folders

from zero_bnb.format.ownership import RECORD_NAME, OutputRecord, checkpoint_strangers, distrust
from zero_bnb.testing.launch import run_distributed

pytestmark = pytest.mark.launch


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


def test_repeated_saves_over_a_users_file_keep_the_users_files_not_copies_of_the_checkpoint(runs):
    # Issue 42, point 3: five saves of "best", a user's file added after each, left 4 whole copies of the checkpoint.
    kept = runs["best_kept"]
    assert len(kept) == 4 and all(name.startswith("best.replaced-") for name in kept), list(kept)
    assert sorted(files for tree in kept.values() for files in tree.items()) == [
        (f"eval-{index}.json", b"{\"acc\": 0.%d}" % index) for index in range(4)]  # only the user's file in each
    assert "eval-4.json" in runs["best_now"] and "zero_bnb/manifest.json" in runs["best_now"]


def test_the_kept_files_step_keeps_empty_folders_foreign_files_and_a_checkpoint_killed_mid_replacement(runs):
    # The adversarial probe of point 3: an empty user folder was removed; as root, a listed file another user owns
    # was removed; a save killed while a leftover was being replaced lost the tag's only complete copy; a failed
    # removal of zero_bnb's own files failed a save that was already published.
    folders, files = runs["probe_kept"]
    assert folders == ["my_empty", "my_empty/deeper"], folders
    expected = (["mp_rank_00_model_states.pt"] if runs["probe_root"] else []) + ["notes.txt"]
    assert files == expected, files
    assert runs["left_error"] is not None and "injected: killed" in runs["left_error"], runs["left_error"]
    assert runs["left_kept_whole"]
    assert runs["strip_failed"] is None and runs["strip_failed_latest"] == "mine"
    message = runs["staging_removed_early"]
    assert message is not None and "was removed while the save ran" in message and "same shared folder" not in \
        message, message


def test_a_manifest_another_user_could_write_proves_nothing(runs):
    # Issue 42, point 4: a re-signed manifest listing the user's files made a save delete them.
    for attack in runs["attacks"]:
        assert runs[f"attack_{attack}"] == {"notes.txt": b"mine", "taxes/2025.pdf": b"%PDF-1.7"}, attack


def test_an_output_record_proves_ownership_only_when_the_running_user_alone_can_write_it(tmp_path, caplog):
    # Issue 42, point 4: a hand-written .zero_bnb-outputs.json listing a user's files (true size and SHA-256) in a
    # shared folder made zero_to_fp32 delete them.
    (tmp_path / "notes.txt").write_bytes(b"mine")
    record = OutputRecord(str(tmp_path))
    record.note("notes.txt", str(tmp_path / "notes.txt"))
    old = os.umask(0o002)  # a umask that leaves files group-writable: zero_bnb's record is not
    try:
        record.save()
    finally:
        os.umask(old)
    path = tmp_path / RECORD_NAME
    assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0
    assert OutputRecord(str(tmp_path)).owns("notes.txt")  # the control: the running user's record proves it
    path.chmod(0o664)
    assert not OutputRecord(str(tmp_path)).owns("notes.txt")
    assert f"{path} proves nothing: it is writable by its group (mode -rw-rw-r--)" in caplog.text
    if os.geteuid() == 0:  # another user's record: only root can make one here
        path.chmod(0o644)
        os.chown(path, 65534, 65534)
        assert not OutputRecord(str(tmp_path)).owns("notes.txt")
        assert "it is owned by user id 65534, not by the running user (0)" in caplog.text
    assert distrust(os.lstat(tmp_path)) == "it is not a regular file"


def test_strangers_are_named_by_path(tmp_path):
    assert checkpoint_strangers(str(tmp_path)) == []
    (tmp_path / "zero_bnb").mkdir()
    (tmp_path / "zero_bnb" / "x.pt").write_bytes(b"1")
    (tmp_path / "y").symlink_to("zero_bnb")
    assert checkpoint_strangers(str(tmp_path)) == ["y", "zero_bnb/x.pt"]  # no manifest: every entry
