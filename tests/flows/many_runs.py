"""Many runs at once: ``--runs`` pipelines started together through the deployments on one Prefect
server, one S3 store (moto) and one MLflow server, then each of the same configs alone; every run must
complete, each concurrent run must equal its run alone, and nothing may cross between runs. Run by
hand (not collected by pytest; it stands on ``tests/flows/test_deployments.py``'s harness):

    .venv/bin/python -m tests.flows.many_runs                       # 4 runs, gpu pool limit 4, ~30 min
    .venv/bin/python -m tests.flows.many_runs --gpu-slots 1         # the stage flows queue on one slot
    .venv/bin/python -m tests.flows.many_runs trainer.total_iterations=2  # extra overrides, last wins

Set-up (not timed), each process in its own session and stopped by its process group at the end: a
Prefect server on a free 127.0.0.1 port with its own PREFECT_HOME, ``infra/local/s3_server.sh`` (moto)
with a fresh bucket, ``infra/local/mlflow_server.sh``; ``infra/prefect/create_pools.sh GPU_SLOTS``,
``prefect --no-prompt deploy --all`` and one process worker per pool, as ``tests/flows/test_deployments.py``.

Run K (seed ``trainer.seed=K+1``) is ``prefect deployment run rlhf-pipeline/quickstart --watch`` with
``execution.mode=deployments``, ``store.url=s3://BUCKET/many``, the MLflow server, the
``tests/flows/test_deployments.TINY`` config and the positional overrides; first all as ``many-K`` at
once, then one after another as ``alone-K``. Wall time of each ``prefect deployment run`` command.

The code under test is a copy of the checkout's files taken at the start (``VERL_FLOW_HOME`` and
``PYTHONPATH`` point at it), so edits to the tree during the run do not reach the flow runs.

Checks (exit 1 if any fails): every run completed; ``many-K`` and ``alone-K`` have the same final
policy sha256 and the same artifact fingerprint (:func:`stages.floor.fingerprint.fingerprint`); the store
holds only the expected runs, each manifest's ``run_id`` is its own, every input manifest lies in its
own run, ``run.json`` has its own seed; MLflow has exactly one run per run id, FINISHED, with its own
seed as a param, metrics logged and one registered model version, and no other MLflow run; different
seeds give different weights; the stage flow runs of the concurrent runs overlapped on the gpu pool.

Figures measured so far: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from stages.floor.fingerprint import fingerprint  # noqa: E402
from tests.flows.test_deployments import TINY  # noqa: E402
from tests.prefect_server import Processes, _api, wait_healthy  # noqa: E402
from tests.reliability.conftest import free_port  # noqa: E402
from verl_core.store import ArtifactStore  # noqa: E402

BIN = Path(sys.executable).parent
S3_ENV = {  # as tests/conftest.py
    "AWS_ACCESS_KEY_ID": "verl-flow-test",
    "AWS_SECRET_ACCESS_KEY": "verl-flow-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _snapshot(dest: Path) -> str:
    """Copy the checkout's files (tracked and untracked, not ignored) to ``dest``, with a link to its
    .venv: every process runs this code even while the tree is edited. Returns the code version."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    (dest / ".venv").symlink_to(BIN.parent)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    return head.stdout.strip() + (" + uncommitted changes" if dirty.strip() else "")


def _wait_http(url: str, timeout: float, what: str) -> None:
    """Until ``url`` answers any HTTP status."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} at {url} not up after {timeout:g} s") from None
            time.sleep(0.5)


def _wait_workers(api: str, pools: Sequence[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    for pool in pools:
        while not any(w["status"] == "ONLINE" for w in _api(api, f"/work_pools/{pool}/workers/filter", {})):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker of pool {pool!r} online after {timeout:g} s")
            time.sleep(1)


def _start_services(procs: Processes, root: Path, code: Path, gpu_slots: int) -> tuple[str, str]:
    """moto with a bucket, MLflow, the Prefect server with the pools, deployments and one worker per
    pool; sets the endpoint and tracking URI in ``procs.env``: ``(store URL, tracking URI)``."""
    import boto3

    env, prefect = procs.env, str(BIN / "prefect")
    s3_port, mlflow_port = free_port(), free_port()
    endpoint, tracking = f"http://127.0.0.1:{s3_port}", f"http://127.0.0.1:{mlflow_port}"
    procs.start("s3", "bash", str(code / "infra/local/s3_server.sh"), str(s3_port))
    procs.start(
        "mlflow", "bash", str(code / "infra/local/mlflow_server.sh"), str(mlflow_port), str(root / "mlflow")
    )
    port = env["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0]
    procs.start(
        "server", prefect, "server", "start", "--host", "127.0.0.1", "--port", port, "--analytics-off"
    )
    _wait_http(endpoint, 60, "moto")
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="many-runs")
    _wait_http(f"{tracking}/health", 120, "MLflow")
    wait_healthy(env["PREFECT_API_URL"], 120)
    env.update(
        {
            "AWS_ENDPOINT_URL_S3": endpoint,
            "MLFLOW_TRACKING_URI": tracking,  # read by `prefect deploy` (the team deployments)
            "VERL_FLOW_STORE_URL": "s3://many-runs/team",
        }
    )
    _run(env, code, "bash", str(code / "infra/prefect/create_pools.sh"), str(gpu_slots))
    _run(env, code, prefect, "--no-prompt", "deploy", "--all")  # prefect.yaml of the snapshot
    procs.start("worker-cpu", prefect, "worker", "start", "--pool", "cpu", "--name", "cpu-1")
    procs.start("worker-gpu", prefect, "worker", "start", "--pool", "gpu", "--name", "gpu-1")
    _wait_workers(env["PREFECT_API_URL"], ["cpu", "gpu"])
    return "s3://many-runs/many", tracking


def _run(env: dict[str, str], cwd: Path, *args: str, timeout: float = 300) -> None:
    out = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def _start_pipeline(
    env: dict[str, str], overrides: list[str], run_id: str, log: Path, timeout: float
) -> tuple[subprocess.Popen[bytes], float]:
    params = json.dumps({"overrides": overrides, "run_id": run_id})
    cmd = [str(BIN / "prefect"), "deployment", "run", "rlhf-pipeline/quickstart", "--params", params,
           "--watch", "--watch-interval", "2", "--watch-timeout", str(int(timeout))]  # fmt: skip
    with log.open("wb") as f:
        p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    return p, time.perf_counter()


def _wait_all(
    started: dict[str, tuple[subprocess.Popen[bytes], float]], timeout: float
) -> dict[str, float | None]:
    """Seconds each run took (None: failed or timed out)."""
    deadline = time.perf_counter() + timeout
    out: dict[str, float | None] = {}
    for run_id, (p, t0) in started.items():
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        out[run_id] = time.perf_counter() - t0 if rc == 0 else None
    return out


def _final_policy(store: ArtifactStore, run_id: str) -> str:
    ckpts = sorted(m.stage for m in store.list_manifests(run_id) if m.stage.startswith("ckpt/"))
    m = store.committed(run_id, ckpts[-1])
    assert m is not None
    return f"{ckpts[-1]} {hashlib.sha256(store.read_bytes(m, 'policy/model.safetensors')).hexdigest()}"


def _store_crosstalk(store: ArtifactStore, run_id: str, seed: int) -> list[str]:
    """Problems of run ``run_id``'s prefix: a manifest of another run, an input from another run, or
    a run record that is not its own."""
    bad = []
    own = f"/{store.run_dir(run_id)}/"
    for m in store.list_manifests(run_id):
        if m.run_id != run_id:
            bad.append(f"{m.stage}: manifest of run {m.run_id}")
        bad += [f"{m.stage}: input {k} = {v['uri']}" for k, v in m.inputs.items() if own not in v["uri"]]
    record = store.read_run_record(run_id)
    if record.run_id != run_id or record.config["trainer"]["seed"] != seed:
        bad.append(f"run.json: run {record.run_id}, seed {record.config['trainer']['seed']}")
    return bad


def _mlflow_problems(tracking: str, run_id: str, seed: int) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    exp = client.get_experiment_by_name("verl-flow")
    if exp is None:
        return ["no experiment verl-flow"]
    found = client.search_runs([exp.experiment_id], f"tags.`verl_flow.run_id` = '{run_id}'")
    if len(found) != 1:
        return [f"{len(found)} MLflow runs"]
    r = found[0]
    bad = [] if r.info.status == "FINISHED" else [f"status {r.info.status}"]
    if r.data.params.get("trainer.seed") != str(seed):
        bad.append(f"param trainer.seed = {r.data.params.get('trainer.seed')}")
    if not r.data.metrics:
        bad.append("no metrics")
    model = r.data.tags.get("verl_flow.registered_model")
    if model is None:
        bad.append("no registered model")
    else:
        name, version = model.split("/")
        if client.get_model_version(name, version).run_id != r.info.run_id:
            bad.append(f"model {model} belongs to another MLflow run")
    return bad


def _mlflow_run_count(tracking: str) -> int:
    """MLflow runs in the experiment "verl-flow" (every run logs there)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking)
    exp = client.get_experiment_by_name("verl-flow")
    return 0 if exp is None else len(client.search_runs([exp.experiment_id], max_results=1000))


def _gpu_overlap(api: str, until: datetime) -> int:
    """Most gpu-pool flow runs running at one moment among those started before ``until``."""
    runs = _api(api, "/flow_runs/filter", {"limit": 200})
    edges = []
    for fr in runs:
        if fr["work_pool_name"] == "gpu" and fr["start_time"] and fr["end_time"]:
            start = datetime.fromisoformat(fr["start_time"])
            if start < until:
                edges += [(start, 1), (datetime.fromisoformat(fr["end_time"]), -1)]
    most = now = 0
    for _, step in sorted(edges):
        now += step
        most = max(most, now)
    return most


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=4, help="pipelines started together")
    parser.add_argument("--gpu-slots", type=int, default=4, help="concurrency limit of the gpu pool")
    parser.add_argument("--timeout", type=float, default=2400, help="seconds allowed to each phase")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, MLflow)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides after the tiny config")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "-m", "tests.flows.many_runs", *sys.argv[1:]])

    root = Path(tempfile.mkdtemp(prefix="verl-flow-many-runs-"))
    os.environ.update(S3_ENV)  # this process creates the bucket and reads the store
    code = root / "code"
    version = _snapshot(code)
    api = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,
        **S3_ENV,
        "PREFECT_HOME": str(root / "prefect-home"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",
        "VERL_FLOW_HOME": str(code),  # where the flow runs start (prefect.yaml's pull step)
        "PYTHONPATH": str(code),  # ahead of the editable install of the checkout
        "VERL_FLOW_DATA_PREFIX": str(root / "snapshots"),
    }
    procs = Processes(env, root)
    failures: list[str] = []
    many: dict[str, float | None] = {}
    alone: dict[str, float | None] = {}
    policies: dict[str, str] = {}
    together, overlap = 0.0, 0
    try:
        store_url, tracking = _start_services(procs, root, code, args.gpu_slots)
        os.environ["AWS_ENDPOINT_URL_S3"] = env["AWS_ENDPOINT_URL_S3"]  # to read the store here

        common = ["execution.mode=deployments", "execution.poll_interval_s=1", f"store.url={store_url}",
                  f"tracking.uri={tracking}", *TINY, *args.overrides]  # fmt: skip
        seeds = {k: k + 1 for k in range(args.runs)}

        def config(k: int) -> list[str]:
            return [*common, f"trainer.seed={seeds[k]}"]

        print(
            f"{args.runs} runs, gpu pool limit {args.gpu_slots}, code {version}; logs under {root}",
            flush=True,
        )
        t0 = time.perf_counter()
        started = {
            run_id: _start_pipeline(env, config(k), run_id, root / f"{run_id}.log", args.timeout)
            for k, run_id in ((k, f"many-{k}") for k in range(args.runs))
        }
        many = _wait_all(started, args.timeout)
        together = time.perf_counter() - t0
        print(
            f"together: {together:.0f} s  " + "  ".join(f"{r} {s or 0:.0f} s" for r, s in many.items()),
            flush=True,
        )
        phase_end = datetime.now().astimezone()
        for k in range(args.runs):
            run_id = f"alone-{k}"
            one = _start_pipeline(env, config(k), run_id, root / f"{run_id}.log", args.timeout)
            alone.update(_wait_all({run_id: one}, args.timeout))
            print(f"{run_id}: {alone[run_id] or 0:.0f} s", flush=True)

        # checks
        for run_id, s in {**many, **alone}.items():
            if s is None:
                failures.append(f"{run_id}: did not complete (log {root / run_id}.log)")
        store = ArtifactStore(store_url)
        expected = {f"{p}-{k}" for p in ("many", "alone") for k in range(args.runs)}
        if set(store.list_runs()) != expected:
            failures.append(f"store holds runs {sorted(store.list_runs())}, expected {sorted(expected)}")
        policies.update({r: _final_policy(store, r) for r, s in {**many, **alone}.items() if s is not None})
        for k in range(args.runs):
            a, b = f"many-{k}", f"alone-{k}"
            if a not in policies or b not in policies:
                continue
            if policies[a] != policies[b]:
                failures.append(f"{a} vs {b}: final policy {policies[a]} vs {policies[b]}")
            fa, fb = fingerprint(store_url, a), fingerprint(store_url, b)
            if fa != fb:
                diff = sorted(x for x in fa.keys() | fb.keys() if fa.get(x) != fb.get(x))
                failures.append(f"{a} vs {b}: fingerprints differ in {len(diff)} files: {diff[:6]}")
            for run_id in (a, b):
                failures += [f"{run_id} store: {p}" for p in _store_crosstalk(store, run_id, seeds[k])]
                failures += [f"{run_id} MLflow: {p}" for p in _mlflow_problems(tracking, run_id, seeds[k])]
        if _mlflow_run_count(tracking) != 2 * args.runs:
            failures.append(f"MLflow holds {_mlflow_run_count(tracking)} runs, expected {2 * args.runs}")
        finals = [policies[r].split()[1] for r in many if r in policies]
        if len(set(finals)) != len(finals):
            failures.append(f"{len(set(finals))} distinct final policies among {len(finals)} seeds")
        overlap = _gpu_overlap(api, phase_end)
        if args.runs > 1 and args.gpu_slots > 1 and overlap < 2:
            failures.append(
                f"the concurrent runs' gpu flow runs never overlapped (at most {overlap} at once)"
            )
    except Exception as e:  # still report what was measured, and stop everything
        failures.append(f"{type(e).__name__}: {e}")
    finally:
        procs.stop_all()

    times = [s for s in alone.values() if s is not None]
    print(f"\n{'':<26}{'seconds':>9}")
    print(f"{f'{args.runs} runs together':<26}{together:>9.0f}   (gpu flow runs at once: at most {overlap})")
    for run_id, s in alone.items():
        print(f"{run_id + ' alone':<26}{s or float('nan'):>9.0f}   {policies.get(run_id, '')}")
    if times:
        mean = sum(times) / len(times)
        print(f"{'sum of alone':<26}{sum(times):>9.0f}")
        speedup = sum(times) / together if together else float("nan")
        print(f"{'together / one alone':<26}{together / mean:>9.2f}   (sum alone / together: {speedup:.2f})")
    for f in failures:
        print(f"FAILED {f}")
    print(f"checks: {'all passed' if not failures else f'{len(failures)} failed'}")
    print(f"rerun: {command}")
    if args.keep or failures:
        print(f"logs: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
