"""One checkpoint call at a time (``zero_bnb.checkpoint.exclusive``), on a stand-in object: the guard's own edges.
A real engine's overlapping calls (a signal handler, a second thread) are in tests/test_async_save.py."""

import threading

import pytest

from zero_bnb.checkpoint import exclusive
from zero_bnb.errors import CheckpointUsageError


class _Engine:
    def __init__(self, hook=None) -> None:
        self.hook = hook

    @exclusive.one_at_a_time
    def save_checkpoint(self, save_dir):
        if self.hook is not None:
            self.hook()
        return "saved"

    @exclusive.one_at_a_time
    def load_checkpoint(self, load_dir):
        return "loaded"


def test_an_interrupt_right_after_the_lock_is_taken_does_not_lock_the_engine_for_good(monkeypatch):
    # Found by a review: the bookkeeping after acquire() runs Python code, where a pending SIGINT is delivered; the
    # usual "except KeyboardInterrupt: engine.save_checkpoint(...)" must still work.
    engine = _Engine()
    real, interrupted = threading.current_thread, []

    def current_thread():
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(threading, "current_thread", current_thread)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint("x")
    monkeypatch.setattr(threading, "current_thread", real)
    assert engine.save_checkpoint("x") == "saved"


def test_a_call_from_another_thread_is_refused_naming_both_threads_and_the_engine_is_free_afterwards():
    inside, release, refused = threading.Event(), threading.Event(), []

    def hold():
        inside.set()
        release.wait(30)

    engine = _Engine(hook=hold)
    first = threading.Thread(target=engine.save_checkpoint, args=("x",), name="trainer")
    first.start()
    assert inside.wait(30)

    def second():
        with pytest.raises(CheckpointUsageError) as error:
            engine.load_checkpoint("x")
        refused.append(str(error.value))

    caller = threading.Thread(target=second, name="evaluator")
    caller.start()
    caller.join(30)
    release.set()
    first.join(30)
    [message] = refused
    assert message.startswith("load_checkpoint was called while this engine's save_checkpoint is still running "
                              "(thread 'trainer'; this call came from thread 'evaluator')"), message
    engine.hook = None
    assert engine.load_checkpoint("x") == "loaded" and engine.save_checkpoint("x") == "saved"


def test_a_refusal_before_the_holder_named_itself_still_reads_well():
    engine = _Engine()
    running = engine.__dict__.setdefault("_zero_bnb_checkpoint_call", exclusive._Running())
    running.lock.acquire()  # taken, name not set yet (the moment between the holder's acquire and its bookkeeping)
    try:
        with pytest.raises(CheckpointUsageError, match=r"this engine's other checkpoint call is still running "
                                                        r"\(thread '\?'; this call came from thread 'MainThread'\)"):
            engine.save_checkpoint("x")
    finally:
        running.lock.release()
