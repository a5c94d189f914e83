"""format/durable.py's writers: one-pass SHA-256 (large writes hashed on a helper thread), no zip CRC-32 (per thread),
errors kept, the disk's write-back started behind the writer (format/write_back.py); format/direct_io.py's writes
around the page cache."""

from __future__ import annotations

import errno
import fcntl
import os
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from zero_bnb.format import digests, direct_io, durable, write_back

pytestmark = pytest.mark.launch


#: The tree whose zero_bnb these tests import (for a child process).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(durable.__file__))))


def _payload() -> dict:
    generator = torch.Generator().manual_seed(0)
    return {"big": torch.randn(3 << 20, generator=generator),  # 12 MiB: written (and hashed) in large pieces
            "small": torch.arange(7, dtype=torch.int16), "text": "x" * 100, "groups": [{"lr": 0.1}]}


def test_a_saved_file_has_the_digest_and_size_of_its_bytes_and_loads_without_crc32(tmp_path):
    payload = _payload()
    crc_before = torch.serialization.get_crc32_options()
    record = durable.save_torch(payload, str(tmp_path / "a.pt"), root=str(tmp_path))
    assert torch.serialization.get_crc32_options() == crc_before  # the process-wide switch is put back
    assert (record.path, (record.size, record.digest)) == (
        "a.pt", durable.digest_file(str(tmp_path / "a.pt"), record.algorithm))
    assert record.size == os.path.getsize(tmp_path / "a.pt")
    with zipfile.ZipFile(tmp_path / "a.pt") as archive:  # the zip's CRC-32 fields are left empty ...
        assert {info.CRC for info in archive.infolist()} == {0}
    for mmap in (False, True):  # ... and torch.load, which never checks them, reads the file all the same
        loaded = torch.load(tmp_path / "a.pt", weights_only=True, mmap=mmap)
        assert torch.equal(loaded["big"], payload["big"]) and torch.equal(loaded["small"], payload["small"])
        assert loaded["text"] == payload["text"] and loaded["groups"] == payload["groups"]


def test_copies_hashed_on_the_helper_thread_match_a_second_reading(tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(5 * (1 << 20) + 123))  # whole 1 MiB chunks (threaded) and a short tail (inline)
    record = durable.copy_file(str(source), str(tmp_path / "copy.bin"), root=str(tmp_path))
    assert (record.size, record.digest) == durable.digest_file(str(source), record.algorithm)
    assert (tmp_path / "copy.bin").read_bytes() == source.read_bytes()


def _first_large_write(payload: dict) -> int:
    """1-based number of the first write of ``torch.save(payload)`` that is hashed on the helper thread."""
    sizes = []

    class Counting:
        def write(self, data) -> int:
            sizes.append(memoryview(data).nbytes)
            return sizes[-1]

        def flush(self) -> None:
            pass

    torch.save(payload, Counting())
    return next(n for n, size in enumerate(sizes, 1) if size >= durable._PARALLEL_HASH_BYTES)


@pytest.mark.parametrize("error", [OSError(28, "injected: no space left on device"), KeyboardInterrupt()])
def test_an_error_in_a_large_write_reaches_the_caller_with_its_cause(tmp_path, error):
    """The hook fails the first large write (its hash already runs on the helper thread, and is waited for); the
    caller gets that error, not torch's generic one, and the CRC-32 switch is put back."""
    large = _first_large_write(_payload())
    writes = []

    def fail(event, path):
        if event == "write":
            writes.append(path)
            if len(writes) == large:
                raise error

    crc_before = torch.serialization.get_crc32_options()
    previous = durable.set_io_hook(fail)
    try:
        with pytest.raises(type(error)) as raised:
            durable.save_torch(_payload(), str(tmp_path / "b.pt"), root=str(tmp_path))
    finally:
        durable.set_io_hook(previous)
    assert len(writes) == large > 1 and torch.serialization.get_crc32_options() == crc_before
    if isinstance(error, OSError):
        assert "no space left on device" in str(raised.value)


def test_a_thread_still_saving_while_the_interpreter_exits_writes_its_file(tmp_path):
    """A save a (non-daemon) thread finishes after the main thread returned, as a background checkpoint writer
    would: the thread pool refuses new work then, so the large writes are hashed inline instead of failing."""
    import subprocess
    import sys

    script = (
        "import sys, threading, time, torch\n"
        "from zero_bnb.format import durable\n"
        "def late():\n"
        "    time.sleep(1.0)\n"
        f"    record = durable.save_torch({{'big': torch.ones(1 << 20)}}, {str(tmp_path / 'late.pt')!r}, "
        f"root={str(tmp_path)!r})\n"
        "    print(record.digest)\n"
        "threading.Thread(target=late).start()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": _ROOT})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [durable.digest_file(str(tmp_path / "late.pt"), digests.writing_algorithm())[1]]


def test_overlapping_saves_in_threads_put_the_crc32_switch_back(tmp_path):
    """Two threads saving at once (a background checkpoint writer beside the training thread): however their
    starts and ends interleave, the process-wide switch ends as it was, and both files are whole."""
    import threading

    crc_before = torch.serialization.get_crc32_options()
    started, release = threading.Barrier(2), threading.Event()

    def hold(event, path):  # both saves are inside their CRC-32 block before either finishes
        if event == "write" and not release.is_set():
            started.wait(timeout=30)
            release.set()

    records = {}

    def save(name: str) -> None:
        records[name] = durable.save_torch(_payload(), str(tmp_path / name), root=str(tmp_path))

    previous = durable.set_io_hook(hold)
    try:
        threads = [threading.Thread(target=save, args=(name,)) for name in ("a.pt", "b.pt")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        durable.set_io_hook(previous)
    assert torch.serialization.get_crc32_options() == crc_before
    for name, record in records.items():
        assert (record.size, record.digest) == durable.digest_file(str(tmp_path / name), record.algorithm)
    assert sorted(records) == ["a.pt", "b.pt"]


def test_the_crc32_switch_is_this_threads_only_and_torchs_own_setting_is_untouched(tmp_path):
    """While a save of zero_bnb's runs in one thread (an asynchronous save's writer), the user's own torch.save in
    another thread keeps its CRC-32, and torch's process-wide setting never changes, whatever it is."""
    import threading

    inside, done = threading.Event(), threading.Event()

    def hold(event, path):  # zero_bnb's save waits, inside its block, until the user's save is written
        if event == "write" and not inside.is_set():
            inside.set()
            done.wait(timeout=30)

    previous = durable.set_io_hook(hold)
    try:
        for setting in (True, False):
            torch.serialization.set_crc32_options(setting)
            inside.clear(), done.clear()
            ours = threading.Thread(target=durable.save_torch, args=({"w": torch.arange(4096.0)},
                                                                      str(tmp_path / f"ours-{setting}.pt")),
                                    kwargs={"root": str(tmp_path)})
            ours.start()
            assert inside.wait(timeout=30)
            torch.save({"w": torch.arange(4096.0)}, tmp_path / f"user-{setting}.pt")  # the user's, meanwhile
            assert torch.serialization.get_crc32_options() is setting
            done.set()
            ours.join(timeout=60)
            with zipfile.ZipFile(tmp_path / f"user-{setting}.pt") as archive:
                assert (archive.testzip() is None) is setting  # torch's own setting decided the user's file
            with zipfile.ZipFile(tmp_path / f"ours-{setting}.pt") as archive:
                assert {info.CRC for info in archive.infolist()} == {0}  # zero_bnb's: none, either way
    finally:
        durable.set_io_hook(previous)
        torch.serialization.set_crc32_options(True)


@pytest.mark.parametrize("sizes", [[0], [1], [4096], [(1 << 22) - 1, 2], [1 << 22, 1 << 22, 5], [3, (3 << 22) + 17]])
def test_direct_writes_give_the_same_file_record_and_bytes(tmp_path, sizes):
    """Inside direct_writes a file goes around the page cache (O_DIRECT, whole aligned buffers, the tail after it is
    cleared): the same bytes, size and SHA-256 as a buffered write, whatever the pieces' sizes."""
    pieces = [os.urandom(size) for size in sizes]
    writes = lambda writer: [writer.write(piece) for piece in pieces]  # noqa: E731
    buffered = durable._durable_write(str(tmp_path / "buffered"), str(tmp_path), writes)
    opened = []
    real = direct_io.DirectFile.__init__

    def spy(self, descriptor):
        opened.append(os.O_DIRECT & fcntl.fcntl(descriptor, fcntl.F_GETFL))
        real(self, descriptor)

    with direct_io.direct_writes(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct_io.DirectFile, "__init__", spy)
        direct = durable._durable_write(str(tmp_path / "direct"), str(tmp_path), writes)
    assert opened and opened[0], "the file was not opened with O_DIRECT"
    assert (direct.size, direct.digest) == (buffered.size, buffered.digest) == (
        sum(sizes), durable.digest_file(str(tmp_path / "direct"), direct.algorithm)[1])
    assert (tmp_path / "direct").read_bytes() == b"".join(pieces)


def test_direct_writes_fall_back_to_the_page_cache_where_the_file_system_refuses_them(tmp_path, monkeypatch):
    """A file system without O_DIRECT (one refuses the flag, another a direct write) gets a buffered file, whole."""
    payload = {"big": torch.randn(3 << 20)}
    real_write, refused = os.write, []

    def refuse_direct(descriptor, data):
        if os.O_DIRECT & fcntl.fcntl(descriptor, fcntl.F_GETFL):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "direct I/O refused")
        return real_write(descriptor, data)

    monkeypatch.setattr(direct_io.os, "write", refuse_direct)
    with direct_io.direct_writes():
        record = durable.save_torch(payload, str(tmp_path / "a.pt"), root=str(tmp_path))
    assert refused and (record.size, record.digest) == durable.digest_file(str(tmp_path / "a.pt"), record.algorithm)
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["big"], payload["big"])
    monkeypatch.setattr(direct_io.os, "write", real_write)

    # ramfs, tmpfs before Linux 6.6: the file exists, then O_DIRECT is refused (an O_EXCL open retried found it there)
    real_fcntl = direct_io.fcntl.fcntl

    def refuse_o_direct(descriptor, command, *args):
        if command == fcntl.F_SETFL and args and args[0] & os.O_DIRECT:
            raise OSError(errno.EINVAL, "no direct I/O on this file system")
        return real_fcntl(descriptor, command, *args)

    monkeypatch.setattr(direct_io.fcntl, "fcntl", refuse_o_direct)
    with direct_io.direct_writes():
        record = durable.save_torch(payload, str(tmp_path / "b.pt"), root=str(tmp_path))
    assert (record.size, record.digest) == durable.digest_file(str(tmp_path / "b.pt"), record.algorithm)
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "b.pt"]


def _recording_sync_file_range(monkeypatch) -> list[tuple[int, int, int, int]]:
    """Record every ``sync_file_range`` call a :class:`~zero_bnb.format.write_back.WriteBack` makes (and make it)."""
    real = write_back.sync_file_range()
    if real is None:
        pytest.skip("this libc has no sync_file_range (not Linux): files are written without early write-back")
    calls: list[tuple[int, int, int, int]] = []

    def recording(descriptor, offset, nbytes, flags):
        result = real(descriptor, offset, nbytes, flags)
        calls.append((offset, nbytes, flags, result))
        return result

    monkeypatch.setattr(write_back, "sync_file_range", lambda: recording)
    return calls


def _contiguous_ranges(calls: list[tuple[int, int, int, int]], size: int) -> None:
    ends = 0
    for offset, nbytes, flags, result in calls:  # one after the other from the start, each a large range
        assert (offset, flags, result) == (ends, 2, 0), calls  # SYNC_FILE_RANGE_WRITE: start, never wait
        assert nbytes >= write_back.WRITE_BACK_BYTES, calls
        ends = offset + nbytes
    assert ends <= size, (calls, size)


def test_the_disk_starts_writing_each_range_a_file_has_received_and_leaves_the_rest_to_the_fsync(tmp_path):
    if write_back.sync_file_range() is None:
        pytest.skip("this libc has no sync_file_range (not Linux): files are written without early write-back")
    with open(tmp_path / "a.bin", "wb", buffering=0) as handle, ThreadPoolExecutor(1) as pool:
        follower = write_back.WriteBack(handle.fileno(), pool)
        piece = write_back.WRITE_BACK_BYTES
        handle.write(bytes(piece - 1))
        follower.advance(piece - 1)  # under one range: nothing starts
        handle.write(bytes(piece + 2))
        follower.advance(2 * piece + 1)  # two ranges' worth: started together
        deadline = time.monotonic() + 60
        while follower.started != 2 * piece + 1:
            assert time.monotonic() < deadline, follower.started
            time.sleep(0.01)
        handle.write(bytes(piece // 2))
        follower.advance(2 * piece + 1 + piece // 2)  # a tail under one range: left to the fsync
        follower.close()
        assert follower.started == 2 * piece + 1
        os.fsync(handle.fileno())


def test_a_saved_file_is_written_in_ranges_the_disk_may_start_on_and_keeps_its_record(tmp_path, monkeypatch):
    calls = _recording_sync_file_range(monkeypatch)
    payload = {"big": torch.arange(12 << 20, dtype=torch.float32)}  # 48 MiB: one write of the tensor's storage
    record = durable.save_torch(payload, str(tmp_path / "a.pt"), root=str(tmp_path))
    assert (record.size, record.digest) == durable.digest_file(str(tmp_path / "a.pt"), record.algorithm)
    assert torch.equal(torch.load(tmp_path / "a.pt", weights_only=True)["big"], payload["big"])
    _contiguous_ranges(calls, record.size)  # how many started depends on the helper thread's timing

    def fill(writer):
        writer.write(bytes(40 << 20))
        raise OSError(errno.ENOSPC, "No space left on device")

    calls.clear()
    with pytest.raises(OSError, match="No space left"):  # the helper task ends with the file: nothing waits on it
        durable._durable_write(str(tmp_path / "failed.bin"), str(tmp_path), fill)
    _contiguous_ranges(calls, 40 << 20)


def test_write_back_is_advice_a_failed_call_ends_it_quietly_and_the_fsync_still_decides(tmp_path):
    with open(tmp_path / "a.bin", "wb") as handle, ThreadPoolExecutor(1) as pool:
        follower = write_back.WriteBack(-1, pool)  # EBADF: the call fails
        follower.advance(write_back.WRITE_BACK_BYTES)
        follower.close()  # returns: the task ended at the failure
        handle.write(b"x")
        handle.flush()
        os.fsync(handle.fileno())


_INTERRUPTED_SAVES = '''
import os, random, signal, sys, threading, time, torch
from zero_bnb.format import durable
root = sys.argv[1]
shard, small = {"m": torch.randn(8 << 20), "s": torch.randn(1000)}, {"w": torch.randn(1 << 18)}

def save(tag):
    durable.save_torch(shard, os.path.join(root, tag + ".shard"), root=root)
    durable.write_text("{}", os.path.join(root, tag + ".json"), root=root)
    durable.save_torch(small, os.path.join(root, tag + ".model"), root=root)
    for suffix in (".shard", ".json", ".model"):
        os.unlink(os.path.join(root, tag + suffix))

def interrupt(*_):
    raise KeyboardInterrupt

def helpers():
    return [t for t in threading.enumerate() if t.name.startswith("ThreadPoolExecutor")]

signal.signal(signal.SIGALRM, interrupt)
took = []
for warm in range(3):  # the quickest of three: each alarm then falls inside a save however loaded the machine is
    start = time.perf_counter(); save(f"warm{warm}"); took.append(time.perf_counter() - start)
took = min(took)
draw, interrupted = random.Random(0), 0
for trial in range(40):  # one Ctrl-C at a random moment of each save, which is then abandoned
    try:
        signal.setitimer(signal.ITIMER_REAL, draw.uniform(0, took))  # inside: a short alarm may fire at once
        save(f"t{trial}")
        signal.setitimer(signal.ITIMER_REAL, 0)
    except (KeyboardInterrupt, Exception):  # torch.save turns some interrupts into RuntimeError
        interrupted += 1
        for name in os.listdir(root):
            if name.startswith(f"t{trial}."):
                os.unlink(os.path.join(root, name))
signal.signal(signal.SIGALRM, signal.SIG_IGN)
deadline = time.monotonic() + 30
while helpers() and time.monotonic() < deadline:
    time.sleep(0.05)  # a pool whose exit an interrupt cut short ends its idle threads on its own
print(interrupted, len(helpers()), flush=True)
never = threading.Event()

def stalled(writer):  # a daemon thread's file whose rest never arrives: it must not hold up the exit
    writer.write(bytes(20 << 20))
    never.wait()

threading.Thread(target=durable._durable_write, args=(os.path.join(root, "stalled.bin"), root, stalled),
                 daemon=True).start()
time.sleep(0.5)
'''


def test_ctrl_c_anywhere_in_a_save_and_a_stalled_daemon_save_leave_no_thread_that_holds_up_the_exit(tmp_path):
    """The write-back's helper task never waits for the writer (a probe of the first version, which did, hung a
    save, or the exit, in every run of 150 interrupted saves; and a daemon thread's stalled save held the exit)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_SAVES, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": _ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    interrupted, stuck = map(int, done.stdout.split())
    assert interrupted >= 10 and stuck == 0, done.stdout


def test_bytes_written_after_the_fill_ended_are_dropped_not_raised(tmp_path):
    """torch's zip writer, when a torch.save was interrupted before its ``with`` block, writes the archive's end from
    its C++ destructor whenever it is freed: an error raised into that destructor aborts the process (CI saw
    "terminate called after throwing an instance of 'pybind11::error_already_set' ... write to closed file")."""
    kept = []

    def fill(writer):
        writer.write(b"abc")
        kept.append(writer)

    record = durable._durable_write(str(tmp_path / "a.bin"), str(tmp_path), fill)
    assert kept[0].write(b"late bytes") == 10  # the handle is closed: dropped, no ValueError
    assert (record.size, record.digest) == durable.digest_file(str(tmp_path / "a.bin"), record.algorithm)
    assert record.size == 3


def test_a_helper_call_is_waited_for_through_a_storm_of_interrupts_and_hands_back_its_error():
    """HelperCall.wait under SIGALRM every 0.5 ms, each raising KeyboardInterrupt: it returns once the call has ended
    (then re-raises the interrupt), never hangs; concurrent.futures' own wait could leave the future's lock held by
    an interrupt inside it, and the pool thread then never completed the future (a save hung in the full suite)."""
    import signal
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from zero_bnb.format.helper_calls import HelperCall

    release = threading.Event()

    def interrupt(*_):
        if not release.is_set():  # the storm ends with the call: nothing fires into pytest's own code after
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    with ThreadPoolExecutor(2) as pool:
        threading.Timer(0.3, release.set).start()
        try:
            call = HelperCall.submit(pool, release.wait)
            signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
            with pytest.raises(KeyboardInterrupt):
                call.wait()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert call.finished and release.is_set() and call.error is None
        failing = HelperCall.submit(pool, lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result()
    assert HelperCall.submit(pool, print) is None  # a pool that was shut down (the interpreter exiting) runs nothing
