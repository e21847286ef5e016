"""The hang watchdog: beats keep a stage alive, silence fails it (main thread: interrupted even inside a
blocking sleep; another thread: at its next bytecode), a stage stuck in C past the grace period ends
the process, and a disabled watchdog never trips."""

from __future__ import annotations

import threading
import time

import pytest

from verl_core.runtime.watchdog import STALL_EXIT_CODE, Heartbeat, StallError, beat


def test_beats_keep_a_slow_stage_alive() -> None:
    with Heartbeat("sft", 0.5, poll_s=0.05) as hb:
        for step in range(15):  # 1.5 s in all, three times the timeout, never 0.5 s without a beat
            time.sleep(0.1)
            beat(step=step + 1)
    assert hb.message is None


def test_silence_fails_a_stage_blocked_in_the_main_thread() -> None:
    t0 = time.monotonic()
    with pytest.raises(StallError) as err, Heartbeat("ppo_update", 0.5, iteration=7, poll_s=0.05):
        beat(optimizer_steps=3, tokens=4096)
        time.sleep(30)  # blocked in C: the watchdog's signal interrupts it
    elapsed = time.monotonic() - t0
    assert elapsed < 0.5 + 0.5, elapsed  # the timeout + a poll + unwinding
    message = str(err.value)
    assert message.startswith("ppo_update (iteration 7): no progress for 0.5 s (execution.stall_timeout_s)")
    assert "last progress: optimizer_steps=3 tokens=4096 at " in message and "s ago)" in message


def test_silence_fails_a_stage_looping_in_another_thread() -> None:
    caught: list[BaseException] = []

    def stage() -> None:
        try:
            with Heartbeat("rollout", 0.3, iteration=0, poll_s=0.05):
                while True:  # Python code: the asynchronous exception lands at the next bytecode
                    time.sleep(0.01)
        except BaseException as e:
            caught.append(e)

    worker = threading.Thread(target=stage)
    t0 = time.monotonic()
    worker.start()
    worker.join(5)
    assert not worker.is_alive() and time.monotonic() - t0 < 1.0
    assert len(caught) == 1 and isinstance(caught[0], StallError)
    assert "rollout (iteration 0): no progress for 0.3 s" in str(caught[0])
    assert "last progress: none since the stage started at " in str(caught[0])


def test_a_stage_that_does_not_unwind_ends_the_process_after_the_grace_period() -> None:
    exits: list[int] = []
    aborted = threading.Event()
    caught: list[BaseException] = []

    def stage() -> None:
        try:
            with Heartbeat(
                "export", 0.2, grace_s=0.3, poll_s=0.05, on_abort=aborted.set, exit_fn=exits.append
            ):
                time.sleep(1.2)  # in C, in a worker thread: the interrupt waits for the sleep to end
        except BaseException as e:
            caught.append(e)

    worker = threading.Thread(target=stage)
    worker.start()
    assert aborted.wait(2)  # timeout 0.2 + grace 0.3: the process would end here
    assert exits == [STALL_EXIT_CODE]
    worker.join(3)
    assert len(caught) == 1 and isinstance(caught[0], StallError)  # and the stage failed when it woke


def test_a_disabled_watchdog_never_trips() -> None:
    beat(step=1)  # no active heartbeat: nothing happens
    with Heartbeat("eval", 0) as hb:
        time.sleep(0.3)
    assert hb.message is None and not hb.enabled
    assert not any(t.name.startswith("watchdog-") for t in threading.enumerate())


def test_two_stages_side_by_side_each_get_their_own_beats() -> None:
    # an ahead rollout (worker thread) beside an update (this thread): each thread's beats go to the
    # heartbeat it entered, whichever was entered last; a helper thread with none goes to the innermost
    entered, done = threading.Event(), threading.Event()
    rollout: list[Heartbeat] = []

    def ahead() -> None:
        with Heartbeat("rollout", 0) as hb:  # disabled: no monitor, beats still recorded
            rollout.append(hb)
            entered.set()
            done.wait(5)
            beat(sequences=8)

    worker = threading.Thread(target=ahead)
    with Heartbeat("ppo_update", 0) as update:
        worker.start()
        assert entered.wait(5)  # the rollout's heartbeat is now the innermost one
        beat(optimizer_steps=1)
        assert update._last[2] == {"optimizer_steps": 1} and rollout[0]._last[2] == {}
        helper = threading.Thread(target=lambda: beat(scored=4))  # entered none: the innermost
        helper.start()
        helper.join(5)
        assert rollout[0]._last[2] == {"scored": 4} and update._last[2] == {"optimizer_steps": 1}
        done.set()
        worker.join(5)
    assert rollout[0]._last[2] == {"sequences": 8} and update._last[2] == {"optimizer_steps": 1}
