"""The dispatcher's verdict on a stage flow run it dispatched (:class:`flows.dispatch.Watch`), fed
hand-made observations on a made-up clock: when it is lost (claimed, then its stage lease stands still),
when it is unclaimed (no worker online), and what an unreadable lease or another holder's lease counts
as. The fence that stops a flow run given up (its lease revoked, a late start refused) is the lease's:
tests/verl_core/store/test_lease.py. The same logic against a real server, workers killed with -9:
tests/flows/test_deployments.py."""

from __future__ import annotations

from flows.dispatch import UNKNOWN, Verdict, Watch

WAIT, LOST, UNCLAIMED = Verdict.WAIT, Verdict.LOST, Verdict.UNCLAIMED


def watch() -> Watch:
    return Watch("fr-1", lost_after_s=10.0, start_timeout_s=20.0, unclaimed_after_s=30.0)


def test_a_running_flow_run_whose_lease_stands_still_is_lost_after_lost_after_s() -> None:
    w = watch()
    assert w.observe(0.0, "RUNNING", ("fr-1", "v1"), None) is WAIT  # claimed and beating at t=0
    assert w.observe(5.0, "RUNNING", ("fr-1", "v2"), None) is WAIT  # renewed: last beat t=5
    assert w.observe(14.0, "RUNNING", ("fr-1", "v2"), None) is WAIT  # 14 - 5 = 9 <= 10
    assert w.observe(15.5, "RUNNING", ("fr-1", "v2"), None) is LOST  # 15.5 - 5 = 10.5 > 10


def test_a_claimed_flow_run_that_never_beats_is_lost_after_start_timeout_s() -> None:
    w = watch()
    assert w.observe(0.0, "SCHEDULED", None, True) is WAIT  # queued: not claimed, no clock
    assert w.observe(100.0, "PENDING", None, None) is WAIT  # claimed at t=100 (process starting)
    assert w.observe(119.0, "RUNNING", None, None) is WAIT  # 19 <= start_timeout_s 20
    assert w.observe(121.0, "RUNNING", None, None) is LOST  # 21 > 20, no lease ever


def test_an_unreadable_lease_counts_as_a_beat_and_another_holder_does_not() -> None:
    w = watch()
    w.observe(0.0, "RUNNING", ("fr-1", "v1"), None)
    assert w.observe(9.0, "RUNNING", UNKNOWN, None) is WAIT  # store down at t=9: says nothing, beat
    assert w.observe(18.0, "RUNNING", ("fr-1", "v1"), None) is WAIT  # 18 - 9 = 9 <= 10
    # the lease is someone else's (the previous dispatch's, not yet revoked): no beat of ours
    assert w.observe(20.0, "RUNNING", ("fr-0", "v7"), None) is LOST  # 20 - 9 = 11 > 10


def test_the_api_down_keeps_the_clock_on_the_lease() -> None:
    w = watch()
    w.observe(0.0, "RUNNING", ("fr-1", "v1"), None)
    assert w.observe(8.0, None, ("fr-1", "v2"), None) is WAIT  # API silent, lease renewed at t=8
    assert w.observe(17.0, None, ("fr-1", "v2"), None) is WAIT  # 9 <= 10
    assert w.observe(19.0, None, ("fr-1", "v2"), None) is LOST  # 11 > 10: the holder is gone


def test_a_flow_run_waiting_with_no_worker_online_is_unclaimed_after_the_timeout() -> None:
    w = watch()
    assert w.observe(0.0, "SCHEDULED", None, False) is WAIT  # no worker since t=0
    assert w.observe(20.0, "SCHEDULED", None, True) is WAIT  # a worker came back: clock reset
    assert w.observe(25.0, "SCHEDULED", None, False) is WAIT  # none again since t=25
    assert w.observe(50.0, "SCHEDULED", None, None) is WAIT  # workers not read: no change
    assert w.observe(54.0, "SCHEDULED", None, False) is WAIT  # 54 - 25 = 29 <= 30
    assert w.observe(56.0, "SCHEDULED", None, False) is UNCLAIMED  # 31 > 30
    # queued behind other runs with a worker online: waits for ever
    busy = watch()
    assert all(busy.observe(t, "SCHEDULED", None, True) is WAIT for t in (0.0, 1e3, 1e5))


def test_final_states() -> None:
    assert watch().observe(0.0, "COMPLETED", None, None) is Verdict.COMPLETED
    assert watch().observe(0.0, "CRASHED", None, None) is Verdict.CRASHED
    for state in ("FAILED", "CANCELLED", "CANCELLING"):
        assert watch().observe(0.0, state, None, None) is Verdict.FAILED
    paused = watch()  # a person paused it: never lost by silence
    paused.observe(0.0, "RUNNING", ("fr-1", "v1"), None)
    assert paused.observe(1e4, "PAUSED", ("fr-1", "v1"), None) is WAIT
