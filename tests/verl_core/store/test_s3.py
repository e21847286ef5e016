"""The S3 filesystem that rides out an unreachable endpoint (``verl_core/store/s3.py``).

The retry loop runs on a fake clock (its sleeps advance it), so the expected tries, waits and the
moment of failure are worked out by hand below: backoff 1, 2, 4, 8, 15, 15 ... s, the last wait cut
to end on the budget. Then the real filesystem against moto behind the fault proxy, down and up."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from botocore.exceptions import EndpointConnectionError

from tests.reliability.fault_proxy import FaultProxy
from verl_core.errors import StoreUnavailableError
from verl_core.store import ArtifactStore
from verl_core.store.cas import conditional_writes
from verl_core.store.s3 import Outage, OutageTolerantS3FileSystem, call_within_budget

URL = "s3://bkt/team"
REFUSED = EndpointConnectionError(endpoint_url="http://s3.test/bkt/team/x")


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def endpoint(
    t: FakeTime, fails: int, took: float = 0.0, error: Exception = REFUSED
) -> tuple[Callable[[], Awaitable[str]], list[float]]:
    """A request that fails ``fails`` times with ``error``, then answers "ok"; each try takes
    ``took`` seconds (botocore's own attempts). Returns it and the times it was sent."""
    sent: list[float] = []

    async def call() -> str:
        sent.append(t.now)
        t.now += took
        if len(sent) <= fails:
            raise error
        return "ok"

    return call, sent


def run(t: FakeTime, call: Callable[[], Awaitable[str]], outage: Outage, budget_s: float) -> str:
    retried = call_within_budget(
        call, outage=outage, budget_s=budget_s, store_url=URL, clock=t.clock, sleep=t.sleep
    )
    return asyncio.run(retried)


def test_an_outage_shorter_than_the_budget_is_ridden_out(caplog: pytest.LogCaptureFixture) -> None:
    t, outage = FakeTime(), Outage()
    call, sent = endpoint(t, fails=3)
    with caplog.at_level(logging.WARNING, logger="verl_core.store.s3"):
        assert run(t, call, outage, budget_s=10) == "ok"
    # tries at 0, 0+1, 1+2, 3+4: the fourth answers
    assert sent == [0, 1, 3, 7] and t.sleeps == [1, 2, 4]
    assert outage.since is None  # over
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # one when it starts, one when it ends
    assert warnings[0].startswith(f"store {URL}: unreachable (EndpointConnectionError: Could not connect")
    assert warnings[1] == f"store {URL}: reachable again after 7 s"


def test_past_the_budget_it_fails_in_one_line() -> None:
    t, outage = FakeTime(), Outage()
    call, sent = endpoint(t, fails=100)
    with pytest.raises(StoreUnavailableError) as e:
        run(t, call, outage, budget_s=10)
    # 0, 1, 3, 7, then the wait of 8 s is cut to 3 so the last try falls on the budget: 10
    assert sent == [0, 1, 3, 7, 10] and t.sleeps == [1, 2, 4, 3]
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"store {URL}: unreachable for 10 s, longer than store.outage_budget_s=10 ")
    assert "(last error EndpointConnectionError: Could not connect to the endpoint URL" in msg
    assert msg.endswith("what was committed is intact: rerun once the store is back to resume")


def test_the_failure_comes_within_the_budget_plus_one_request() -> None:
    t, outage = FakeTime(), Outage()
    call, sent = endpoint(t, fails=100, took=0.5)  # each try spends 0.5 s in botocore's attempts
    with pytest.raises(StoreUnavailableError, match="unreachable for 10 s"):  # 10.5, printed %.0f
        run(t, call, outage, budget_s=10)
    # sent at 0 (the outage's start), failed at 0.5, sent 1.5, failed 2, sent 4, failed 4.5, sent 8.5,
    # failed 9 (1 s left: the wait is cut to 1), sent 10, failed 10.5 >= 10: the budget + one try
    assert sent == [0, 1.5, 4, 8.5, 10] and t.sleeps == [1, 2, 4, 1]
    assert t.now == 10.5


def test_the_backoff_doubles_up_to_15_s() -> None:
    t, outage = FakeTime(), Outage()
    call, sent = endpoint(t, fails=100)
    with pytest.raises(StoreUnavailableError):
        run(t, call, outage, budget_s=100)
    # 1+2+4+8 = 15, then 15 s five times: 90, then the last 10 s to the budget
    assert t.sleeps == [1, 2, 4, 8, 15, 15, 15, 15, 15, 10]
    assert sent[-1] == 100 and len(sent) == 11


def test_the_budget_is_the_outage_s_not_each_request_s() -> None:
    t, outage = FakeTime(), Outage()
    outage.failed(0.0, 0.0, URL, REFUSED, 10)  # another request saw the endpoint go at 0
    t.now = 5.0
    call, sent = endpoint(t, fails=100)
    with pytest.raises(StoreUnavailableError, match="unreachable for 10 s"):
        run(t, call, outage, budget_s=10)
    # sent 5, wait 1, 6, wait 2, 8, wait min(4, 10 - 8) = 2, 10: the outage has lasted 10 s
    assert sent == [5, 6, 8, 10] and t.sleeps == [1, 2, 2]


def test_after_the_budget_requests_fail_at_once_until_the_next_probe() -> None:
    t, outage = FakeTime(), Outage()
    call, sent = endpoint(t, fails=5)  # fails at 0, 1, 3, 7, 10; the endpoint is back after that
    with pytest.raises(StoreUnavailableError):
        run(t, call, outage, budget_s=10)
    t.now = 12.0  # 2 s after the last failure: not sent at all
    with pytest.raises(StoreUnavailableError, match="unreachable for 12 s"):
        run(t, call, outage, budget_s=10)
    assert len(sent) == 5
    t.now = 25.0  # 15 s after the last failure: probed, answered
    assert run(t, call, outage, budget_s=10) == "ok"
    assert len(sent) == 6 and outage.since is None and not outage.given_up


@pytest.mark.parametrize(
    "answer", [FileNotFoundError("no such key"), PermissionError("access denied"), OSError(22, "412")]
)
def test_answers_of_the_endpoint_pass_through(answer: Exception) -> None:
    t, outage = FakeTime(), Outage()
    call, sent = endpoint(t, fails=1, error=answer)
    with pytest.raises(type(answer)) as e:
        run(t, call, outage, budget_s=10)
    assert e.value is answer and sent == [0] and t.sleeps == [] and outage.since is None


# ------------------------------------------------------------------------------------------------
# The real filesystem: moto behind the fault proxy


@pytest.fixture
def proxied(s3_bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    with FaultProxy(s3_endpoint, rate=0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
        yield proxy, f"{s3_bucket}/team"


@pytest.mark.s3
def test_the_store_rides_out_the_endpoint_going_down(proxied: Any) -> None:
    proxy, url = proxied
    store = ArtifactStore(url, max_attempts=1, outage_budget_s=30)
    assert isinstance(store.fs, OutageTolerantS3FileSystem)
    path = store.path("x")
    store.put_atomic(path, b"data")
    proxy.down()
    threading.Timer(2.0, proxy.up).start()
    t0 = time.monotonic()
    assert store.cat(path) == b"data"  # waited for the endpoint
    assert 1.5 < time.monotonic() - t0 < 10
    with pytest.raises(FileNotFoundError):  # a 404 is an answer: at once
        store.cat(store.path("missing"))


@pytest.mark.s3
def test_the_store_fails_in_one_line_past_the_budget(proxied: Any) -> None:
    proxy, url = proxied
    store = ArtifactStore(url, max_attempts=1, outage_budget_s=1)
    cas = conditional_writes(store.fs, store.url)  # cas.py calls s3fs's sync call_s3: also covered
    with proxy.outage():
        t0 = time.monotonic()
        unreachable = rf"store {url}: unreachable for [12] s, longer than store.outage_budget_s=1 "
        with pytest.raises(StoreUnavailableError, match=unreachable):
            cas.create(store.path("lease.json"), b"{}")
        assert time.monotonic() - t0 < 5
    # back, but the budget was spent moments ago: fails at once (a failing run's cleanup is not held
    # up); the next request 15 s after the last failure would probe the endpoint again (above)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="last error EndpointConnectionError"):
        store.cat(store.path("lease.json"))
    assert time.monotonic() - t0 < 0.5
