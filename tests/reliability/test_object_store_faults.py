"""Object-store faults: the tiny pipeline on S3 (moto) through a proxy that answers ~10% of requests
with 500/503, resets connections (before and after applying the request) or delays them. It must
complete through the configured retries (botocore standard mode via ``store.max_attempts``, Prefect
task retries via ``execution.task_retries``) with exactly the artifacts of an uninterrupted local
run, and leave nothing uncommitted in view."""

from __future__ import annotations

from tests.reliability.conftest import FAULT_RATE, Reference, S3Run, fingerprint, uncommitted


def test_pipeline_survives_a_flaky_object_store(s3_faulty_run: S3Run, reference: Reference) -> None:
    run = s3_faulty_run
    assert run.result.returncode == 0, run.result.output[-5000:]
    print(
        f"\nobject-store faults: {sum(run.faults.values())} injected and survived in {run.requests} "
        f"requests ({FAULT_RATE:.0%} rate): {run.faults}"
    )
    # every kind of fault was exercised, at about the configured rate
    assert set(run.faults) == {"500", "503", "reset", "reset-after", "delay"}, run.faults
    assert 0.04 * run.requests < sum(run.faults.values()) < 0.2 * run.requests
    # read back without the proxy: every committed file matches its manifest and the local run
    assert fingerprint(run.store_url, run.run_id) == reference.fingerprint


def test_nothing_uncommitted_is_left_in_view(s3_faulty_run: S3Run) -> None:
    # every object is the run record, a manifest or a file a manifest lists: no partial attempt of a
    # retried write, no leftover lease
    assert uncommitted(s3_faulty_run.store_url, s3_faulty_run.run_id) == []
