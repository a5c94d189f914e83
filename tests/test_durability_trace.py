"""Durability seen from outside (issue 44 item 3): the system calls of real saves, recorded by an LD_PRELOAD shim.

``tests/csrc/fsync_trace.c``, compiled here with the system C compiler, records every open-to-write, write, fsync,
mkdir, rename and unlink under a folder, in each process of a DP=1 and a DP=2 launch
(``durability_trace_scenarios.traced_saves``: a first save into a new folder, a new tag, an asynchronous new tag, a
re-save of the tag ``latest`` names). From the merged trace (CLOCK_MONOTONIC, so ranks and the background writer's
thread interleave as they ran), a model of the disk replays each call and knows what an fsync has made durable:
a file's bytes up to its last fsync, a folder's entries as of its last fsync (POSIX promises nothing more). The
tests check, from that record alone:

* every file and folder of the new tag (DeepSpeed's model file, every rank's shard, the replicated file, the manifest,
  the ``zero_bnb/`` folder) is durable before ``latest`` is renamed to name it, and ``latest`` itself once the save
  returns (an asynchronous one: once ``wait_for_checkpoint`` returns);
* the crash states a crash after any recorded call may leave (after ALICE and CrashMonkey: a file's bytes since its
  last fsync all kept or all lost; the un-synced entries of folders persisted in call order up to any call, or all
  but those of one call in one folder, a later change persisting while an earlier one is lost) each load, through
  ``zero_bnb.verify_checkpoint`` (every check a load makes), as the previous checkpoint or the new one, and every
  visible tag folder in them is complete. Only what a load may read is built (``latest``, visible folders, a
  re-saved tag's hidden previous folder); staging, private and lock files are left out;
* three mutants, each a save with one of zero_bnb's fsyncs left out, are caught: the first check names exactly what
  was left out, the second finds a crash state that loads a broken checkpoint;
* the fault campaign's kill points (``tests/test_faults.py``, from ``durable.set_io_hook``) land right before a call
  of every kind (file kind, operation) the trace sees, but the ones listed in ``_UNCOVERED``;
* through the front doors that mark their folder unfinished (Trainer's ``checkpoint-N``, Accelerate's
  ``checkpoints/checkpoint_N``; tests/front_door_kills.py's stories at DP=2, synchronous and asynchronous): the
  folder is durable before its mark goes, the mark's removal before the older checkpoint's deletion starts, and every
  crash state leaves the front door's own automatic resume the older or the new checkpoint, byte for byte.

The state before each save is taken as durable (what a crash during the save may lose is the save's own work).
Not modelled: torn writes inside a file (bytes kept up to some offset), Lightning's folders (zero_bnb save folders
themselves, whose ``latest`` the checks above cover), GPU ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from durability_trace_scenarios import MUTANTS, SAVES, traced_saves
from test_faults import kill_points
from zero_bnb import verify_checkpoint
from zero_bnb.errors import CheckpointError
from zero_bnb.format.progress import STAGING_SUFFIX
from zero_bnb.format.publish import TEMP_SUFFIX
from zero_bnb.format.tags import aside_tag
from zero_bnb.testing import warm
from zero_bnb.testing.launch import run_distributed

pytestmark = [pytest.mark.launch, pytest.mark.slow(seconds=50)]

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "csrc", "fsync_trace.c")
_O_CREAT, _O_TRUNC = 0o100, 0o1000  # Linux's values (the recorder writes the flags as the kernel got them)


# ---------------------------------------------------------------------------------------------------------------------
# Recording


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> str:
    if not sys.platform.startswith("linux"):
        pytest.skip("the recorder reads descriptors' paths from /proc/self/fd (Linux)")
    compiler = next((path for path in map(shutil.which, ("cc", "gcc", "clang")) if path), None)
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH to build tests/csrc/fsync_trace.c")
    library = str(tmp_path_factory.mktemp("shim") / "fsync_trace.so")
    built = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-Wall", "-o", library, SHIM, "-ldl"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return library


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded system call (see tests/csrc/fsync_trace.c)."""

    pid: int
    tid: int
    seq: int
    t: int
    op: str
    path: str
    path2: str
    value: int


@dataclass(slots=True)
class Run:
    """One launch: its folder, the recorded calls in time order, and each rank's windows and hook events."""

    workdir: str
    calls: list[Call]
    windows: dict[str, tuple[int, int]]  # save -> (first start, last end) over the ranks
    ranks: list[dict]
    saves: list[str]
    mutants: list[str]


def _calls(logs: str) -> list[Call]:
    """Every call the recorder wrote into ``logs`` (one file per process), in time order."""
    calls = []
    for name in os.listdir(logs):
        with open(os.path.join(logs, name)) as handle:
            for line in handle:
                pid, tid, seq, t, op, path, path2, value = line.rstrip("\n").split("\t")
                calls.append(Call(int(pid), int(tid), int(seq), int(t), op, path, path2, int(value, 16)))
    calls.sort(key=lambda call: (call.t, call.pid, call.seq))
    return _with_hidden_renames(_folders_before_their_use(calls))


def _folders_before_their_use(calls: list[Call]) -> list[Call]:
    """``calls`` with each ``mkdir`` moved before the first call on a path inside its folder. The recorder stamps a
    call after it returned, so where two ranks create the same folder (one gets EEXIST, unrecorded), the other rank's
    first file in it can be stamped before the creator's ``mkdir`` (seen once: 2.9 ms apart on a loaded 2-core box).
    The folder existed when that file was opened, so the move only corrects the order."""
    result = list(calls)
    for call in calls:
        if call.op != "mkdir":
            continue
        inside = call.path.rstrip("/") + "/"
        position = result.index(call)
        first = next((index for index, other in enumerate(result[:position])
                      if other.path.startswith(inside) or other.path2.startswith(inside)), None)
        if first is not None:
            result.insert(first, result.pop(position))
    return result


#: The temporary file of Rust's tempfile crate (safetensors' ``save_file``: Trainer's ``model.safetensors``).
_RUST_TEMP = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")


def _with_hidden_renames(calls: list[Call]) -> list[Call]:
    """``calls`` with the renames no preload sees put in: Rust's tempfile crate publishes its temporary file with a
    raw ``renameat`` instruction (rustix), so a ``.tmpXXXXXX`` file that no call renames or removes is taken as renamed,
    right after its last write, to the first name in its folder that a later call uses and none created."""
    known: set[str] = set()
    hidden: dict[str, int] = {}  # temporary file -> index of its last call
    inserted: dict[int, list[Call]] = defaultdict(list)
    for index, call in enumerate(calls):
        if call.op in ("open", "mkdir"):
            known.add(call.path)
        if call.op in ("rename", "link"):
            known.add(call.path2)
            hidden.pop(call.path, None)
        if call.op == "unlink":
            hidden.pop(call.path, None)
        if _RUST_TEMP.match(os.path.basename(call.path)) and call.op in ("open", "write", "trunc"):
            hidden[call.path] = index
            continue
        if call.path not in known and call.op != "rename":
            folder = os.path.dirname(call.path)
            for temp, last in list(hidden.items()):
                if os.path.dirname(temp) == folder:
                    at = calls[last]
                    inserted[last].append(Call(at.pid, at.tid, at.seq, at.t, "rename", temp, call.path, 0))
                    known.add(call.path)
                    del hidden[temp]
                    break
    return [item for index, call in enumerate(calls) for item in (call, *inserted.get(index, ()))]


@contextmanager
def _recorded(shim: str, root: str, logs: str):
    """The recorder preloaded into every process started in the block (the calling process's environment)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LD_PRELOAD", shim)
        patch.setenv("ZB_TRACE_ROOT", root)
        patch.setenv("ZB_TRACE_LOG", os.path.join(logs, "calls"))
        patch.setenv(warm.WARM_ENV, "0")  # a fresh process per rank: a preload cannot enter the warm server's forks
        yield


def _record(shim: str, workdir: str, world: int, mutants: list[str]) -> Run:
    root, logs = os.path.join(workdir, "root"), os.path.join(workdir, "trace")
    os.makedirs(root)
    os.makedirs(logs)
    with _recorded(shim, root, logs):  # the spawned ranks get the calling process's environment
        run_distributed(traced_saves, world, workdir, mutants)
    calls = _calls(logs)
    with open(os.path.join(workdir, "run.json")) as handle:
        run = json.load(handle)
    ranks = run["ranks"]
    windows = {name: (min(rank[name]["start"] for rank in ranks), max(rank[name]["end"] for rank in ranks))
               for name in ranks[0]}
    return Run(workdir, calls, windows, run["ranks"], run["saves"], run["mutants"])


@pytest.fixture(scope="module")
def runs(shim, tmp_path_factory) -> dict[int, Run]:
    return {world: _record(shim, str(tmp_path_factory.mktemp(f"dp{world}")), world,
                           list(MUTANTS) if world == 1 else [])
            for world in (1, 2)}


# ---------------------------------------------------------------------------------------------------------------------
# A model of the disk: what the calls did, and what fsyncs made durable


@dataclass(slots=True)
class Node:
    """A file or folder: volatile state (what processes see) and durable state (what survives a crash for sure)."""

    number: int
    folder: bool
    entries: dict[str, int] = field(default_factory=dict)  # folders: name -> node
    durable: dict[str, int] = field(default_factory=dict)  # folders: the entries as of the last fsync
    pending: list[tuple[int, str, int | None]] = field(default_factory=list)  # folders: (call, name, node) since the last fsync
    size: int = 0  # files: bytes written
    synced: int = 0  # files: bytes made durable
    source: tuple[str, str] | None = None  # files: (save, path under root) where the snapshots hold its bytes


class Disk:
    """Replays recorded calls on the folder ``root`` (empty and durable at first)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.nodes = [Node(0, True)]
        self.index = -1  # of the last call replayed

    def lookup(self, path: str, entries: str = "entries") -> int | None:
        relative = os.path.relpath(path, self.root)
        node = 0
        for part in [] if relative == "." else relative.split("/"):
            node = getattr(self.nodes[node], entries).get(part)
            if node is None:
                return None
        return node

    def _parent(self, path: str) -> tuple[Node, str]:
        parent = self.lookup(os.path.dirname(path))
        assert parent is not None and self.nodes[parent].folder, f"the trace names {path}, whose folder the model lacks"
        return self.nodes[parent], os.path.basename(path)

    def _set(self, folder: Node, name: str, node: int | None) -> None:
        if node is None:
            folder.entries.pop(name)
        else:
            folder.entries[name] = node
        folder.pending.append((self.index, name, node))

    def _new(self, folder: bool) -> int:
        self.nodes.append(Node(len(self.nodes), folder))
        return len(self.nodes) - 1

    def replay(self, call: Call) -> None:
        self.index += 1
        if call.op == "open":
            existing = self.lookup(call.path)
            if existing is None:
                assert call.value & _O_CREAT, call
                folder, name = self._parent(call.path)
                self._set(folder, name, self._new(False))
            elif call.value & _O_TRUNC:
                self.nodes[existing].size = 0
        elif call.op in ("write", "trunc"):
            node = self.lookup(call.path)
            if node is not None:  # a file removed while open is written no more in this protocol
                self.nodes[node].size = self.nodes[node].size + call.value if call.op == "write" else call.value
        elif call.op == "fsync":
            node = self.lookup(call.path)
            assert node is not None, f"fsync of {call.path}, which the model does not have"
            self._sync(self.nodes[node])
        elif call.op == "sync":
            self.sync_all()
        elif call.op == "mkdir":
            folder, name = self._parent(call.path)
            self._set(folder, name, self._new(True))
        elif call.op in ("rename", "link"):
            node = self.lookup(call.path)
            assert node is not None, call
            if call.op == "rename":
                folder, name = self._parent(call.path)
                self._set(folder, name, None)
            folder, name = self._parent(call.path2)
            self._set(folder, name, node)
        elif call.op == "unlink":
            folder, name = self._parent(call.path)
            self._set(folder, name, None)
        else:
            raise AssertionError(f"unknown call {call}")

    def _sync(self, node: Node) -> None:
        if node.folder:
            node.durable, node.pending = dict(node.entries), []
        else:
            node.synced = node.size

    def sync_all(self) -> None:
        for node in self.nodes:
            self._sync(node)

    def walk(self, node: int, path: str, entries=lambda node: node.entries):
        """``(path, node)`` of ``node`` and everything under it, through ``entries(folder)``."""
        yield path, self.nodes[node]
        if self.nodes[node].folder:
            for name, child in sorted(entries(self.nodes[node]).items()):
                yield from self.walk(child, f"{path}/{name}", entries)


def _windows_of(run: Run):
    """Replay the run; yield ``(save, disk, calls)`` at the start of each save's window, the disk taken as synced (the
    caller replays ``calls``, the window's, and may look at the disk between them); after the window, the files the
    save created get their bytes' source (:func:`_note_sources`)."""
    disk = Disk(os.path.join(run.workdir, "root"))
    position = 0
    for name in sorted(run.windows, key=lambda name: run.windows[name][0]):
        start, end = run.windows[name]
        while position < len(run.calls) and run.calls[position].t < start:
            disk.replay(run.calls[position])
            position += 1
        disk.sync_all()
        inside = []
        while position < len(run.calls) and run.calls[position].t <= end:
            inside.append(run.calls[position])
            position += 1
        replayed = disk.index
        yield name, disk, inside
        assert disk.index == replayed + len(inside), f"the caller did not replay the calls of {name}"
        _note_sources(disk, run.workdir, name)


def _note_sources(disk: Disk, workdir: str, snapshot: str, top: int = 0, *, complete: bool = True) -> None:
    """Files under node ``top`` without a source get their bytes from ``{workdir}/snap/{snapshot}`` (a copy of what
    ``top`` held then; files are written once), whose size must be the recorded one (a write the recorder missed
    would show here). ``complete``: every such file is in the snapshot (else one that is not stays without)."""
    for path, node in disk.walk(top, ""):
        if not node.folder and node.source is None:
            copy = os.path.join(workdir, "snap", snapshot, path.lstrip("/"))
            if complete or os.path.exists(copy):
                assert os.path.getsize(copy) == node.size, (snapshot, path, os.path.getsize(copy), node.size)
                node.source = (snapshot, path.lstrip("/"))


def _save_folder(run: Run, save: str) -> str:
    return "ckpt" if save in run.saves else f"mutant_{save.split(':')[0]}"


def _previous(run: Run, save: str) -> str | None:
    """The save before ``save`` into the same folder (``None``: the folder's first)."""
    if save in run.saves:
        index = run.saves.index(save)
        return run.saves[index - 1] if index else None
    return None if save.endswith(":P") else f"{save}:P"


def _latest(run: Run, save: str | None, folder: str) -> str | None:
    """What ``latest`` named after ``save``."""
    if save is None:
        return None
    path = os.path.join(run.workdir, "snap", save, folder, "latest")
    return open(path).read() if os.path.exists(path) else None


# ---------------------------------------------------------------------------------------------------------------------
# Check 1: durable before `latest` moves


def _not_durable(disk: Disk, folder: int, names: list[str], base: str) -> list[str]:
    """What of ``folder``'s entries ``names`` (and everything under them) a crash now could lose."""
    problems = []
    for name in names:
        node = disk.nodes[folder].entries.get(name)
        if node is None:
            problems.append(f"{base}{name}: missing")
            continue
        if disk.nodes[folder].durable.get(name) != node:
            problems.append(f"{base}{name}: entry not fsynced")
        for path, item in disk.walk(node, f"{base}{name}"):
            if item.folder:
                problems += [f"{path}/{child}: entry not fsynced" for child, target in item.entries.items()
                             if item.durable.get(child) != target]
            elif item.synced < item.size:
                problems.append(f"{path}: content not fsynced ({item.synced} of {item.size} bytes)")
    return sorted(problems)


def durability_report(run: Run) -> dict[str, dict[str, list[str]]]:
    """Per save: what of the new tag was not durable when ``latest`` was renamed to name it (``before latest``); what
    of the tag and ``latest`` was not durable when the save returned (``at return``; an asynchronous save: when
    ``wait_for_checkpoint`` returned); whether the save folder's own entry in its parent was (``save folder``)."""
    report = {}
    for save, disk, calls in _windows_of(run):
        folder = _save_folder(run, save)
        save_path = os.path.join(disk.root, folder)
        tag = _latest(run, save, folder)
        latest = os.path.join(save_path, "latest")
        renames = [n for n, call in enumerate(calls) if call.op == "rename" and call.path2 == latest]
        assert len(renames) == 1, (save, renames)
        for call in calls[: renames[0]]:
            disk.replay(call)
        before = _not_durable(disk, disk.lookup(save_path), [tag], f"{folder}/")
        for call in calls[renames[0]:]:
            disk.replay(call)
        root = disk.nodes[0]
        report[save] = {"before latest": before,
                        "at return": _not_durable(disk, disk.lookup(save_path), [tag, "latest"], f"{folder}/"),
                        "save folder": [] if root.durable.get(folder) == root.entries[folder] else
                        [f"{folder}: entry not fsynced"]}
    return report


# ---------------------------------------------------------------------------------------------------------------------
# Check 2: every crash state loads as the previous or the new checkpoint

#: A crash state of a save folder: ``(path under it, is a folder, node, bytes)`` of everything in it, sorted.
State = tuple[tuple[str, bool, int, int], ...]


def _views(disk: Disk):
    """``(label, entries)`` of each way the un-synced folder entries may have reached the disk: in order up to each
    call (the synced entries alone, ..., all of them), or all but those one call changed in one folder (a later
    change persisted, an earlier one lost; a rename's two folders separately)."""
    pending = [(node, change) for node in disk.nodes if node.folder for change in node.pending]

    def keeping(keep):
        def entries(node: Node) -> dict[str, int]:
            result = dict(node.durable)
            for change in node.pending:
                if keep(node.number, change[0]):
                    if change[2] is None:
                        result.pop(change[1], None)
                    else:
                        result[change[1]] = change[2]
            return result
        return entries

    for last in sorted({-1, *(change[0] for _, change in pending)}):
        yield f"entries up to call {last}", keeping(lambda node, index, last=last: index <= last)
    for number, call in sorted({(node.number, change[0]) for node, change in pending}):
        names = [change[1] for change in disk.nodes[number].pending if change[0] == call]
        yield (f"all entries but those call {call} changed in folder {number} ({', '.join(names)})",
               keeping(lambda folder, index, lost=(number, call): (folder, index) != lost))


def _read_by_loads(path: str) -> bool:
    """Whether a load may read ``path`` (under a save folder): ``latest``, the visible folders, and the hidden name
    a tag's previous folder takes while it is re-saved (``zero_bnb.format.tags.resolve_tag``); staging, private and
    lock files are left out of the crash states (each such difference alone would be one more state to load)."""
    top = path.lstrip("/").split("/")[0]
    return not top.startswith(".") or top.endswith(aside_tag("")[1:])


def crash_states(disk: Disk, folder: str) -> dict[State, str]:
    """The states a crash now may leave of the save folder ``folder`` (under the disk's root), each with a label."""
    states: dict[State, str] = {}
    for label, entries in _views(disk):
        for contents in ("volatile", "durable"):
            state: list[tuple[str, bool, int, int]] = []
            top = entries(disk.nodes[0]).get(folder)
            if top is not None:
                for path, node in disk.walk(top, "", entries):
                    assert path.count("/") < 8, f"a cycle of folders at {path}"
                    if not _read_by_loads(path):
                        continue
                    state.append((path.lstrip("/"), node.folder, node.number,
                                  0 if node.folder else node.size if contents == "volatile" else node.synced))
            states.setdefault(tuple(state), f"{label}, {contents} file contents")
    return states


def _materialize(run: Run, disk: Disk, state: State, where: str) -> None:
    os.makedirs(where)
    for path, folder, number, size in state:
        target = os.path.join(where, path)
        if folder:
            os.makedirs(target, exist_ok=True)
            continue
        source = disk.nodes[number].source  # None: a file removed in the save that made it (the lock's record)
        data = b"\0" * size
        if source is not None:
            with open(os.path.join(run.workdir, "snap", *source)) as handle:
                data = handle.buffer.read(size)
        with open(target, "wb") as handle:
            handle.write(data)


def _manifest(folder: str) -> bytes:
    with open(os.path.join(folder, "zero_bnb", "manifest.json"), "rb") as handle:
        return handle.read()


def _outcome(where: str, previous: bytes | None, new: bytes) -> str:
    """``previous``, ``new``, ``none`` (no ``latest``), or what is wrong with the crash state at ``where``."""
    wrong = []
    for name in sorted(os.listdir(where)):  # a visible tag folder must be complete: a user may load it by its tag
        if not name.startswith(".") and os.path.isdir(os.path.join(where, name)):
            try:
                verify_checkpoint(where, name)
            except CheckpointError as error:
                wrong.append(f"visible folder {name} is broken: {type(error).__name__}: {error}")
    if not os.path.exists(os.path.join(where, "latest")):
        return "; ".join(wrong + ["no latest"]) if wrong or previous is not None else "none"
    try:
        loaded = _manifest(verify_checkpoint(where).tag_folder)
    except CheckpointError as error:
        return "; ".join(wrong + [f"the load fails: {type(error).__name__}: {error}"])
    found = "previous" if loaded == previous else "new" if loaded == new else "another checkpoint"
    return "; ".join(wrong + [found]) if wrong or found == "another checkpoint" else found


def _states_through(disk: Disk, calls: list[Call], folder: str) -> dict[State, str]:
    """Every crash state of ``folder`` from now through ``calls`` (each replayed), labelled with where it first
    arose."""
    states = {state: f"before the first call: {label}" for state, label in crash_states(disk, folder).items()}
    for call in calls:
        disk.replay(call)
        where = f"after {call.op} {os.path.relpath(call.path, disk.root)}" + (
            f" -> {os.path.relpath(call.path2, disk.root)}" if call.path2 else "")
        for state, label in crash_states(disk, folder).items():
            states.setdefault(state, f"{where} (call {disk.index}): {label}")
    return states


def crash_report(run: Run, scratch: str) -> dict[str, dict[str, list[str]]]:
    """Per save: outcome -> the crash states (where and how) that load so; see :func:`_outcome`."""
    collected = []
    for save, disk, calls in _windows_of(run):
        folder = _save_folder(run, save)
        collected.append((save, folder, disk, _states_through(disk, calls, folder)))
    report: dict[str, dict[str, list[str]]] = {}
    for number, (save, folder, disk, states) in enumerate(collected):
        previous = _previous(run, save)
        snap = lambda name: os.path.join(run.workdir, "snap", name, folder)  # noqa: E731
        before = None if previous is None else _manifest(os.path.join(snap(previous), _latest(run, previous, folder)))
        after = _manifest(os.path.join(snap(save), _latest(run, save, folder)))
        outcomes = report.setdefault(save, defaultdict(list))
        for count, (state, label) in enumerate(states.items()):
            where = os.path.join(scratch, f"{number}-{count}", folder)
            _materialize(run, disk, state, where)
            outcomes[_outcome(where, before, after).replace(where, folder)[:400]].append(label)
            shutil.rmtree(os.path.dirname(where))
    return {save: dict(outcomes) for save, outcomes in report.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Check 3: the fault campaign's kill points land before every kind of call the trace sees

#: The fault campaign's save modes (tests/fault_injection.py MODES) and the traced saves that are the same saves.
_CAMPAIGN_MODES = {"new": "new", "overwrite": "overwrite", "async_new": "async_new"}


def kind_of(path: str) -> str:
    """What a path under a save folder is, by its name (the kinds of file and folder a save touches)."""
    name = os.path.basename(path)
    kinds = {".zero_bnb.lock": "lock file", "latest": "latest", "zero_to_fp32.py": "zero_to_fp32.py",
             "replicated.pt": "replicated.pt", "manifest.json": "manifest.json", "zero_bnb": "zero_bnb folder",
             "mp_rank_00_model_states.pt": "model states file", "ckpt": "save folder"}
    if name in kinds:
        return kinds[name]
    if name.startswith("shard_"):
        return "shard"
    if STAGING_SUFFIX in name:
        return "trash folder" if name.endswith("-replaced") else "staging folder"
    if name.endswith(aside_tag("")[1:]):
        return "aside folder"
    if name.endswith(TEMP_SUFFIX):
        return "private folder"
    return "tag folder" if len(name) == 1 else f"unknown ({name})"


def _step(call: Call) -> tuple[str, str]:
    op = {"open": "create", "unlink": "remove"}.get(call.op, call.op)
    if call.op == "fsync" and kind_of(call.path).endswith("folder"):
        op = "fsync folder"
    return kind_of(call.path), op


def coverage(run: Run) -> tuple[set, set, list[dict]]:
    """``(traced, covered, trials)``: the (kind, operation) of every call of the campaign's saves (at DP=2, both
    ranks), and of the calls that a kill point of the campaign lands right before (the next call of the thread whose
    hook event the trial kills at; another thread's call then races with the kill); ``trials`` from
    tests/test_faults.py's own ``kill_points``."""
    events = [{mode: [[event, os.path.basename(path)] for _, _, event, path in rank[save]["events"]]
               for mode, save in _CAMPAIGN_MODES.items()} for rank in run.ranks]
    trials = kill_points(events)
    traced, covered = set(), set()
    for save in _CAMPAIGN_MODES.values():
        start, end = run.windows[save]
        traced |= {_step(call) for call in run.calls if start <= call.t <= end}
    for trial in trials:
        rank = run.ranks[trial["victim"]][_CAMPAIGN_MODES[trial["mode"]]]
        moment, thread, _, _ = rank["events"][trial["index"]]
        following = [call for call in run.calls
                     if (call.pid, call.tid) == (rank["pid"], thread) and moment < call.t <= rank["end"]]
        if following:
            covered.add(_step(following[0]))
    return traced, covered, trials


#: (kind, operation) the trace sees that no kill point of the campaign lands right before, and why that is acceptable.
#: The crash states above are built after every recorded call, these included.
_UNCOVERED = {
    ("lock file", "write"): "the save folder lock's record (format/lock.py writes it with os.write, no hook event)",
    ("lock file", "fsync"): "the lock record's fsync (format/lock.py, no hook event)",
    ("lock file", "remove"): "the lock's release after the commit (format/lock.py, no hook event)",
    ("private folder", "remove"): "StagedFile.discard's rmtree of latest's and zero_to_fp32.py's private folders",
    **{(kind, "remove"): "the replaced tag's files, removed by rmtree under its hidden trash name after one hook "
                         "event for the whole folder (format/durable.py remove_tree)"
       for kind in ("trash folder", "zero_bnb folder", "model states file", "shard", "replicated.pt", "manifest.json")},
}


@pytest.fixture(scope="module")
def durability(runs) -> dict[int, dict]:
    return {world: durability_report(run) for world, run in runs.items()}


@pytest.fixture(scope="module")
def crashes(runs, tmp_path_factory) -> dict[int, dict]:
    return {world: crash_report(run, str(tmp_path_factory.mktemp(f"crash{world}"))) for world, run in runs.items()}


@pytest.mark.parametrize("world", [1, 2])
def test_every_file_and_folder_of_a_checkpoint_is_fsynced_before_latest_names_it(runs, durability, world):
    report = durability[world]
    for save in runs[world].saves:  # synchronous and asynchronous, a new tag and a re-saved one
        assert report[save]["before latest"] == [] and report[save]["at return"] == [], (save, report[save])
    assert [report[save]["save folder"] for save in runs[world].saves[1:]] == [[]] * 3  # (the first save: below)


def test_a_save_folder_the_first_save_creates_is_durable_in_its_parent(durability):
    # found by this trace: the save folder's parent was never fsynced (os.makedirs in checkpoint/commit.py _prepare),
    # so by POSIX the save folder, with every checkpoint in it, could vanish after a crash
    assert durability[1]["first"]["save folder"] == [] and durability[2]["first"]["save folder"] == []


def test_a_save_without_one_of_its_fsyncs_is_named_exactly(durability):
    report = durability[1]
    manifest = "mutant_manifest_fsync/M/zero_bnb/manifest.json: content not fsynced (0 of "
    assert [line.startswith(manifest) for line in report["manifest_fsync"]["before latest"]] == [True], report
    assert report["manifest_fsync"]["at return"] == report["manifest_fsync"]["before latest"]
    assert report["subfolder_fsync"]["before latest"] == report["subfolder_fsync"]["at return"] == [
        f"mutant_subfolder_fsync/M/zero_bnb/{name}: entry not fsynced"
        for name in ("manifest.json", "replicated.pt", "shard_00000-of-00001.pt")]
    # the tag's rename is made durable only by the fsync that follows latest's rename: durable at return, too late
    assert report["tag_rename_fsync"]["before latest"] == ["mutant_tag_rename_fsync/M: entry not fsynced"]
    assert report["tag_rename_fsync"]["at return"] == []
    for mutant in MUTANTS:  # the same save without the mutation is clean
        assert report[f"{mutant}:P"]["before latest"] == report[f"{mutant}:P"]["at return"] == []


@pytest.mark.parametrize("world", [1, 2])
def test_every_crash_state_of_a_save_loads_the_previous_or_the_new_checkpoint(runs, crashes, world):
    report = crashes[world]
    for save in runs[world].saves:
        allowed = {"previous", "new"} if _previous(runs[world], save) else {"none", "new"}
        assert set(report[save]) <= allowed, {save: {outcome: labels[:3] for outcome, labels in report[save].items()
                                                     if outcome not in allowed}}
        assert set(report[save]) == allowed, (save, report[save])  # both ends reached: the states are not all one


def test_a_save_without_one_of_its_fsyncs_has_a_crash_state_that_loads_a_broken_checkpoint(crashes):
    report = crashes[1]
    for mutant in MUTANTS:
        broken = {outcome: labels for outcome, labels in report[mutant].items() if outcome not in ("previous", "new")}
        assert broken, (mutant, report[mutant])
        assert set(report[f"{mutant}:P"]) == {"none", "new"}, report[f"{mutant}:P"]
    # the reordering a crash may bring: latest's rename persisted, the tag folder's earlier rename lost
    [(outcome, labels)] = [item for item in report["tag_rename_fsync"].items() if item[0] not in ("previous", "new")]
    assert "(tag 'M' from mutant_tag_rename_fsync/latest) does not exist" in outcome, outcome
    assert all("all entries but those call" in label and ", M)" in label for label in labels), labels


def test_the_fault_campaigns_kill_points_land_before_every_kind_of_call_of_a_save(runs):
    traced, covered, trials = coverage(runs[2])
    assert not [kind for kind, _ in traced if kind.startswith("unknown")], traced
    assert len(trials) >= 100, len(trials)  # tests/test_faults.py: at least 70 synchronous and 30 asynchronous
    assert {step: _UNCOVERED.get(step, "not declared") for step in traced - covered} == _UNCOVERED
    # every write, fsync, creation and rename of a file or folder a checkpoint needs is a kill point
    assert not {step for step in traced - covered if step[1] not in ("remove",) and step[0] != "lock file"}


# ---------------------------------------------------------------------------------------------------------------------
# Front doors: a Trainer or Accelerate checkpoint folder counts once its mark is gone


@dataclass(slots=True)
class DoorRun:
    """The front doors' launch: the recorded calls, and per story (``{door}_{mode}``) the save under test's window."""

    workdir: str
    calls: list[Call]
    windows: dict[str, tuple[int, int]]
    statuses: dict[str, dict[str, str]]


@pytest.fixture(scope="module")
def door_run(shim, tmp_path_factory) -> DoorRun:
    from durability_trace_scenarios import FRONT_DOORS, serve_front_doors

    from zero_bnb.testing.forks import run_server

    workdir = str(tmp_path_factory.mktemp("front_doors"))
    root, logs = os.path.join(workdir, "root"), os.path.join(workdir, "trace")
    os.makedirs(root)
    os.makedirs(logs)
    with _recorded(shim, root, logs):
        run_server(serve_front_doors, workdir, list(FRONT_DOORS), what="the front doors' recorded server")
    with open(os.path.join(workdir, "front_doors.json")) as handle:
        statuses = json.load(handle)
    windows = {}
    for name in statuses:
        with open(os.path.join(workdir, f"{name}.json")) as handle:
            window = json.load(handle)
        windows[name] = (window["start"], window["end"])
    return DoorRun(workdir, _calls(logs), windows, statuses)


def _door_window(run: DoorRun, name: str) -> tuple[Disk, list[Call]]:
    """The disk replayed up to the start of story ``name``'s window, taken as synced, and the window's calls."""
    start, end = run.windows[name]
    disk = Disk(os.path.join(run.workdir, "root"))
    for call in (call for call in run.calls if call.t < start):
        disk.replay(call)
    disk.sync_all()
    _note_sources(disk, run.workdir, f"{name}:before", disk.lookup(os.path.join(disk.root, name)), complete=False)
    return disk, [call for call in run.calls if start <= call.t <= end]


def front_door_report(run: DoorRun, name: str) -> dict[str, list[str] | None]:
    """What of the new checkpoint folder was not durable when its mark was removed (``before complete``), and
    whether that removal was when the older folder's deletion began (``before deletion``); ``None``: never happened."""
    import front_door_kills as kills

    from zero_bnb.format.progress import SAVING_NAME

    spec = kills.DOORS[name.rsplit("_", 1)[0]]
    disk, calls = _door_window(run, name)
    folder = os.path.join(disk.root, name)
    second, first = os.path.join(folder, spec.second[0]), os.path.join(folder, spec.first)
    marker = os.path.join(second, SAVING_NAME)
    report: dict[str, list[str] | None] = {"before complete": None, "before deletion": None}
    for call in calls:
        removes = call.op in ("unlink", "rename")
        if report["before complete"] is None and removes and call.path == marker:
            parent = os.path.dirname(spec.second[0])
            report["before complete"] = [
                problem for problem in _not_durable(disk, disk.lookup(os.path.dirname(second)),
                                                    [os.path.basename(second)], f"{parent}/")
                if not problem.lstrip("/").startswith(f"{spec.second[0]}/{SAVING_NAME}")]
        if report["before deletion"] is None and removes and (call.path == first or call.path.startswith(first + "/")):
            synced = SAVING_NAME not in disk.nodes[disk.lookup(second)].durable
            report["before deletion"] = [] if synced else [f"{spec.second[0]}/{SAVING_NAME}: removal not fsynced"]
        disk.replay(call)
    return report


def front_door_crashes(run: DoorRun, name: str, scratch: str) -> dict[str, list[str]]:
    """Outcome -> the crash states of story ``name``'s folder during the save under test that give it: ``previous``
    or ``new`` when the folder the front door's automatic resume picks holds that checkpoint byte for byte."""
    import front_door_kills as kills

    import zero_bnb

    spec = kills.DOORS[name.rsplit("_", 1)[0]]
    disk, calls = _door_window(run, name)
    states = _states_through(disk, calls, name)
    _note_sources(disk, run.workdir, f"{name}:after", disk.lookup(os.path.join(disk.root, name)), complete=False)
    snap = os.path.join(run.workdir, "snap")
    previous = kills._folder_state(os.path.join(snap, f"{name}:before", spec.first), content=True)
    new = kills._folder_state(os.path.join(snap, f"{name}:after", spec.second[0]), content=True)
    outcomes: dict[str, list[str]] = defaultdict(list)
    with zero_bnb.enabled():
        for count, (state, label) in enumerate(states.items()):
            where = os.path.join(scratch, str(count), name)
            _materialize(run, disk, state, where)
            try:
                pick = spec.pick(where)
            except Exception as error:  # noqa: BLE001 - an outcome (Accelerate raises when it finds nothing complete)
                outcomes[f"the pick failed: {type(error).__name__}: {error}".replace(scratch, "")[:300]].append(label)
                shutil.rmtree(os.path.dirname(where))
                continue
            found = "none" if pick is None else kills._folder_state(pick, content=True)
            outcome = {previous: "previous", new: "new"}.get(found, f"another: {found[:12]} picked at {pick}")
            if outcome in ("previous", "new") and os.path.relpath(pick, where) != (
                    spec.first if outcome == "previous" else spec.second[0]):
                outcome = f"{outcome} under another name: {pick}"
            outcomes[outcome.replace(scratch, "")].append(label)
            shutil.rmtree(os.path.dirname(where))
    return dict(outcomes)


@pytest.mark.slow
def test_a_front_doors_folder_is_durable_before_its_mark_goes_and_its_mark_before_the_older_one_is_deleted(
        door_run, tmp_path):
    """Trainer's ``checkpoint-2`` and Accelerate's ``checkpoints/checkpoint_1``, saved at DP=2 synchronously and
    asynchronously: everything in the folder (the front door's files and zero_bnb's checkpoint) and its entry are
    durable when the mark goes, the mark's removal is durable when the older checkpoint's deletion starts, and every
    crash state during the save leaves the front door's automatic resume the older checkpoint or the new one, byte
    for byte (both reached)."""
    assert set(door_run.statuses) == {f"{door}_{mode}" for door in ("trainer", "accelerate")
                                      for mode in ("sync", "async")}
    for name, status in door_run.statuses.items():
        assert set(status.values()) == {"exit 0"}, (name, status)
        report = front_door_report(door_run, name)
        assert report == {"before complete": [], "before deletion": []}, (name, report)
        crashes = front_door_crashes(door_run, name, str(tmp_path / name))
        assert set(crashes) == {"previous", "new"}, (name, {outcome: labels[:3] for outcome, labels in crashes.items()})
