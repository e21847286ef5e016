"""The object store down for a while (not per-request faults: the endpoint refuses every connection):
the tiny pipeline on S3 (moto) behind the fault proxy, which goes down mid-run, twice.

1. Longer than ``store.outage_budget_s`` (10 s), from the first rollout's commit on: the run fails in
   one line naming the store and the setting, soon after the budget; what it had committed is intact.
2. The store back, the rerun of the run id (budget 90 s) meets a 30 s outage from the second
   rollout's commit on, waits it out (requests retried with backoff), resumes without redoing a
   committed stage and ends exactly as an uninterrupted local run, nothing uncommitted in view.

One run and its rerun serve both cases (a run of its own each would cost a minute more).
``store.max_attempts=3`` keeps botocore's own retries of each request to a few seconds, so the
failure comes close to the budget (see ``verl_core/store/s3.py``)."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.reliability.conftest import (
    Pipeline,
    Reference,
    Result,
    attempts,
    fingerprint,
    finish,
    uncommitted,
)
from tests.reliability.fault_proxy import FaultProxy

BUDGET_S = 10
GIVE_UP = ["store.max_attempts=3", f"store.outage_budget_s={BUDGET_S}"]
OUTAGE_S = 30  # the lower bound of a real outage (30-120 s)
RIDE_OUT = ["store.max_attempts=3", f"store.outage_budget_s={3 * OUTAGE_S}"]
BUCKET, RUN = "reliability-outage", "outage"
STORE = f"s3://{BUCKET}/team"


def _bucket(s3_endpoint: str, name: str) -> Any:
    import boto3

    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")  # moto itself, no proxy
    s3.create_bucket(Bucket=name)
    return s3


def _wait_for_commit(
    s3: Any, bucket: str, key: str, proc: subprocess.Popen[str], timeout: float = 240
) -> None:
    """Until the manifest ``key`` exists (read from moto directly, past the proxy)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount"):
            return
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended before {key} was committed:\n{out[-3000:]}\n{err[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"{key} not committed in {timeout} s")


def test_the_proxy_outage_refuses_connections_then_serves_on_the_same_port(s3_endpoint: str) -> None:
    with FaultProxy(s3_endpoint, rate=0.0) as proxy:
        port = int(proxy.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as idle:  # an open keep-alive connection
            time.sleep(0.1)  # accepted
            with proxy.outage():
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection(("127.0.0.1", port), timeout=2)
                assert idle.recv(1) == b""  # cut
            assert proxy.dropped == 1
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert conn.recv(12).startswith(b"HTTP/1.1 ")  # forwarded to moto again


@dataclass(frozen=True)
class Outages:
    failed: Result  # the run the long outage stopped
    failed_after: float  # seconds from the endpoint going down to that run's exit
    committed: dict[str, str]  # {stage: attempt} when it had failed
    committed_fingerprint: dict[str, str]
    rerun: Result  # the rerun that met the short outage
    rerun_log: str  # its full log


@pytest.fixture(scope="module")
def outages(
    pipeline: Pipeline, s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Outages]:
    s3 = _bucket(s3_endpoint, BUCKET)
    workdir = tmp_path_factory.mktemp("outage-run")
    manifest = f"team/runs/{RUN}/{{}}/manifest.json"
    with FaultProxy(s3_endpoint, rate=0.0) as proxy:
        env = {"AWS_ENDPOINT_URL_S3": proxy.url, "AWS_DEFAULT_REGION": "us-east-1"}
        # 1. down from the first rollout's commit on, for longer than the budget
        proc = pipeline.start(STORE, RUN, overrides=GIVE_UP, env=env, cwd=workdir)
        t0 = time.perf_counter()
        _wait_for_commit(s3, BUCKET, manifest.format("iter-0000/rollout"), proc)
        proxy.down()
        down_at = time.perf_counter()
        failed = finish(proc, t0)
        failed_after = time.perf_counter() - down_at
        committed = attempts(STORE, RUN)  # read from moto directly, past the proxy
        committed_fingerprint = fingerprint(STORE, RUN)  # every committed file matches its manifest
        assert "iter-0001/rollout" not in committed
        print(f"\nstore down: the run failed {failed_after:.1f} s later (budget {BUDGET_S} s)")
        print("\n".join(line for line in failed.stderr.splitlines() if line.startswith("error:")))
        # 2. back; the rerun meets a shorter outage from the second rollout's commit on
        proxy.up()
        t0 = time.perf_counter()
        proc = pipeline.start(STORE, RUN, overrides=RIDE_OUT, env=env, cwd=workdir)
        _wait_for_commit(s3, BUCKET, manifest.format("iter-0001/rollout"), proc)
        with proxy.outage():
            time.sleep(OUTAGE_S)
        rerun = finish(proc, t0)
    rerun_log = sorted((workdir / "logs" / RUN).glob("*.log"))[-1].read_text()  # {time}-{pid}.log
    yield Outages(failed, failed_after, committed, committed_fingerprint, rerun, rerun_log)


def test_an_outage_past_the_budget_fails_in_one_line(outages: Outages, reference: Reference) -> None:
    r = outages.failed
    assert r.returncode == 1, r.output[-5000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-5000:]
    line = errors[0]
    # where the outage stopped it (not the lease release that failed after it), then what and why
    assert re.match(rf"error: (stage|flow) [^:]+: store {STORE}: unreachable for \d+ s, ", line), line
    assert "finish-run" not in line, line
    assert f"longer than store.outage_budget_s={BUDGET_S} " in line, line
    assert "what was committed is intact: rerun once the store is back to resume" in line, line
    assert "Traceback" not in r.stderr
    # the budget, plus one request's own botocore attempts (3), plus the process winding down
    assert BUDGET_S <= outages.failed_after < BUDGET_S + 30
    # what it had committed is what the uninterrupted run has
    assert "sft" in outages.committed and "iter-0000/rollout" in outages.committed
    fp = outages.committed_fingerprint
    assert {k: reference.fingerprint.get(k) for k in fp} == fp


def test_the_rerun_waits_out_an_outage_shorter_than_the_budget(outages: Outages) -> None:
    r = outages.rerun
    assert r.returncode == 0, r.output[-5000:]
    log = outages.rerun_log
    waited = [int(s) for s in re.findall(rf"store {STORE}: reachable again after (\d+) s", log)]
    print(f"\nstore outage of {OUTAGE_S} s waited out: {waited} s, rerun {r.seconds:.0f} s")
    assert waited and max(waited) >= OUTAGE_S - 5, log[-5000:]  # it stood still, then went on


def test_the_rerun_resumes_to_the_uninterrupted_run(outages: Outages, reference: Reference) -> None:
    after = attempts(STORE, RUN)
    assert {s: after[s] for s in outages.committed} == outages.committed  # nothing committed was redone
    assert fingerprint(STORE, RUN) == reference.fingerprint
    assert uncommitted(STORE, RUN) == []  # no partial attempt of the interrupted stages, no stale lease
