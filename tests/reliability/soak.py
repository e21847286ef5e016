"""Soak: the reliability suite's tiny pipeline, many times, on S3 (moto) behind the fault proxy, each
attempt killed with SIGKILL from outside at a random moment until one completes; every finished run
must equal an uninterrupted local run (artifact digests as in tests/reliability, policy tensors).
Run by hand (not collected by pytest: the suite's faults at length, on the suite's own harness):

    .venv/bin/python -m tests.reliability.soak --runs 5 --fault-rate 0.1 --kills 2

Prints per run: attempts, kill times, requests, faults by kind; then totals: runs, kills survived,
faults injected/survived, wall time. Exits 1 if any run ends different from the reference.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from stages.floor.fingerprint import fingerprint  # noqa: E402
from tests.reliability.conftest import CANARIES, Pipeline, finish, prefect_server  # noqa: E402
from tests.reliability.fault_proxy import FaultProxy  # noqa: E402
from verl_core.runtime.env import set_quiet_env  # noqa: E402


def _one_run(
    pipeline: Pipeline,
    proxy_url: str,
    store_url: str,
    run_id: str,
    kills: int,
    kill_window: tuple[float, float],
    rng: random.Random,
    workdir: Path,
) -> tuple[int, list[float], bool]:
    """Attempts until the run completes: the first ``kills`` attempts are SIGKILLed after a random
    delay in ``kill_window`` seconds (if still running). Returns (attempts, kill delays, ok)."""
    env = {**CANARIES, "AWS_ENDPOINT_URL_S3": proxy_url, "AWS_DEFAULT_REGION": "us-east-1"}
    delays: list[float] = []
    for attempt in range(1, kills + 10):
        t0 = time.perf_counter()
        proc = pipeline.start(store_url, run_id, env=env, cwd=workdir)
        if attempt <= kills:
            delay = rng.uniform(*kill_window)
            try:
                proc.wait(timeout=delay)
            except Exception:
                os.kill(proc.pid, signal.SIGKILL)
                delays.append(round(delay, 1))
        result = finish(proc, t0, timeout=600)
        if result.returncode == 0:
            return attempt, delays, True
        if result.returncode not in (-signal.SIGKILL,):
            print(f"  attempt {attempt} failed (exit {result.returncode}):\n{result.output[-3000:]}")
            return attempt, delays, False
    return kills + 10, delays, False


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="pipeline runs to complete")
    parser.add_argument("--fault-rate", type=float, default=0.1, help="share of S3 requests hit by a fault")
    parser.add_argument("--kills", type=int, default=2, help="random SIGKILLs per run before it may finish")
    parser.add_argument("--kill-min-s", type=float, default=12.0, help="earliest kill, seconds after start")
    parser.add_argument("--kill-max-s", type=float, default=40.0, help="latest kill, seconds after start")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    set_quiet_env(offline=True)
    import boto3
    from moto.server import ThreadedMotoServer

    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        root = Path(tmp)
        (root / "prefect").mkdir()
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        os.environ.update({k: "soak" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="soak")
        try:
            with prefect_server(root / "prefect") as pipeline:
                print("reference run (local store, no faults, no kills) ...", flush=True)
                ref = pipeline.run(str(root / "reference"), "reference", cwd=root)
                if ref.returncode != 0:
                    print(ref.output[-3000:])
                    return 1
                reference = fingerprint(str(root / "reference"), "reference")
                faults: Counter[str] = Counter()
                requests = kills_done = failures = 0
                for i in range(args.runs):
                    run_id = f"soak-{i}"
                    with FaultProxy(endpoint, rate=args.fault_rate, seed=args.seed + i) as proxy:
                        t0 = time.perf_counter()
                        attempts, delays, ok = _one_run(
                            pipeline,
                            proxy.url,
                            "s3://soak/team",
                            run_id,
                            args.kills,
                            (args.kill_min_s, args.kill_max_s),
                            rng,
                            root,
                        )
                    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint  # read back without faults
                    got = fingerprint("s3://soak/team", run_id) if ok else {}
                    same = ok and got == reference
                    if ok and not same:
                        diff = sorted(k for k in set(got) | set(reference) if got.get(k) != reference.get(k))
                        print(f"  differs from the reference in: {diff}")
                    failures += not same
                    faults.update(proxy.counts)
                    requests += proxy.requests
                    kills_done += len(delays)
                    print(
                        f"run {run_id}: {'OK' if same else 'DIFFERENT/FAILED'} "
                        f"in {time.perf_counter() - t0:.0f} s, "
                        f"{attempts} attempts, killed at {delays} s, {proxy.requests} requests, "
                        f"faults {dict(proxy.counts)}",
                        flush=True,
                    )
        finally:
            moto.stop()
    total = sum(faults.values())
    survived = total if failures == 0 else "n/a"
    print(
        f"\nsoak: {args.runs} runs, {failures} different or failed; {kills_done} SIGKILLs survived; "
        f"{total} faults injected / {survived} survived in {requests} requests "
        f"({args.fault_rate:.0%} rate: {dict(faults)}); {time.perf_counter() - t_start:.0f} s wall"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
