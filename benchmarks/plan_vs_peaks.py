"""``verl-flow plan``'s memory against a run's measured peaks, per process (issue 37 item 4).

Runs ``verl-flow run CONFIG OVERRIDES`` (store ``--store``) in a subprocess and samples its process
tree every 0.2 s (``/proc/PID/status``): the peak of the summed ``VmRSS`` of each role, ``trainer``
(the ``verl-flow`` process), ``vllm`` (the engine subprocess and its children) and ``prefect-server``
(a temporary API server), and each role's largest ``VmHWM``. Then it plans the same config
(:func:`verl_core.planning.memory.plan_memory`, at the run's mean prompt and response lengths and at
the config's maxima) and prints predicted against measured. ``--scale-json``: the same for
``benchmarks/scale.py``'s records (their peak RSS of the trainer and of the vLLM process tree). Not a
test: runs of the size asked for.

    flock /tmp/heavy.lock .venv/bin/python -m benchmarks.plan_vs_peaks configs/quickstart_grpo.yaml \\
        rollout.name=vllm trainer.total_iterations=2 --store /tmp/peaks/store --json /tmp/peaks/qs.json
    .venv/bin/python -m benchmarks.plan_vs_peaks --scale-json /tmp/scale/scale.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[1]


def _status_kib(pid: int, key: str) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _role(cmdline: str, parent: str) -> str:
    """``vllm`` (the engine and its children), ``prefect-server`` (a temporary API server), or the
    parent's role."""
    if "vllm" in cmdline or parent == "vllm":
        return "vllm"
    if "prefect.server" in cmdline or parent == "prefect-server":
        return "prefect-server"
    return parent


def measure(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, dict[str, float]]:
    """Run ``cmd``; per role the peak of its processes' summed RSS and the largest single ``VmHWM``
    (GiB), and the wall seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    roles: dict[int, str] = {proc.pid: "trainer"}
    hwm: dict[str, int] = {}
    summed: dict[str, int] = {}
    while proc.poll() is None:
        stack, now = [proc.pid], {}
        while stack:
            pid = stack.pop()
            kids = _children(pid)
            for k in kids:
                if k not in roles:
                    line = _cmdline(k)
                    roles[k] = _role(line, roles[pid])
            stack += kids
            role = roles.get(pid, "trainer")
            now[role] = now.get(role, 0) + _status_kib(pid, "VmRSS")
            hwm[role] = max(hwm.get(role, 0), _status_kib(pid, "VmHWM"))
        for role, kib in now.items():
            summed[role] = max(summed.get(role, 0), kib)
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    return {
        r: {
            "peak_rss_gib": summed.get(r, 0) / 2**20,
            "max_hwm_gib": hwm[r] / 2**20,
            "wall_s": wall,
            "rc": proc.returncode,
        }
        for r in hwm
    }


def mean_lengths(store: Path) -> tuple[int, int] | None:
    """Mean prompt and response tokens of the rollouts the run wrote under ``store``."""
    import pyarrow.parquet as pq

    p = r = n = 0
    for path in store.rglob("rollouts.parquet"):
        t = pq.read_table(path, columns=["prompt_ids", "response_ids"]).to_pydict()
        p += sum(map(len, t["prompt_ids"]))
        r += sum(map(len, t["response_ids"]))
        n += len(t["prompt_ids"])
    return (round(p / n), round(r / n)) if n else None


def from_scale(path: Path) -> list[dict[str, object]]:
    """Predicted against measured for each record of ``benchmarks/scale.py``'s JSON (its config: the
    quickstart + the record's overrides; the plan at the record's mean lengths): trainer and vLLM."""
    from verl_core.config import load_config
    from verl_core.planning.memory import plan_memory

    rows = []
    for rec in json.loads(path.read_text()):
        cfg = load_config(REPO / "configs" / "quickstart.yaml", rec["config_overrides"])
        last = rec["iterations"][-1]
        plan = plan_memory(
            cfg, prompt_tokens=round(last["prompt_tokens"]), response_tokens=round(last["response_tokens"])
        )
        by_role = {p.role: p for p in plan.processes}
        # the peak within the flow (before the benchmark reads its checkpoint back and generates with
        # the HF engine), where the record has it
        peak = rec.get("peak_rss_flow") or rec["peak_rss"]
        for role, measured in (("trainer", peak["trainer"]), ("vllm", peak["vllm_tree"])):
            p = by_role[role]
            # the trainer's exact high-water mark also covers what the benchmark does after the run
            # (its checkpoint read back, the HF engine's generation)
            hwm = rec["peak_rss"].get("trainer_ru_maxrss") if role == "trainer" else None
            rows.append({
                "size": rec["size"], "algo": rec["algo"], "process": role,
                "predicted_gib": p.peak_bytes / GIB, "phase": p.peak_phase,
                "measured_gib": measured / GIB, "error": p.peak_bytes / measured - 1,
                "ru_maxrss_gib": hwm / GIB if hwm else None,
                "components_gib": {c.name: round(c.nbytes / GIB, 3) for c in p.components()},
            })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--store", help="a fresh store directory for the run (store.url)")
    ap.add_argument("--scale-json", help="compare with benchmarks/scale.py's records instead of running")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--log", default="/tmp/plan_vs_peaks.log", help="the run's output")
    args = ap.parse_args()
    if args.scale_json:
        for row in from_scale(Path(args.scale_json)):
            print(json.dumps(row))
        return
    overrides = [*args.overrides, f"store.url={args.store}"]
    env = dict(os.environ, DO_NOT_TRACK="1", MLFLOW_DISABLE_TELEMETRY="true", HF_HUB_OFFLINE="1")
    verl_flow = str(Path(sys.executable).with_name("verl-flow"))
    measured = measure([verl_flow, "run", args.config, *overrides], env, Path(args.log))
    from verl_core.config import load_config
    from verl_core.planning.memory import plan_memory

    cfg = load_config(args.config, overrides)
    lengths = mean_lengths(Path(args.store))
    bound = plan_memory(cfg)
    at_lengths = plan_memory(cfg, prompt_tokens=lengths[0], response_tokens=lengths[1]) if lengths else bound
    rows = {}
    for p, q in zip(bound.processes, at_lengths.processes, strict=True):
        got = measured.get(p.role, {})
        rows[p.name] = {
            "predicted_bound_gib": p.peak_bytes / GIB,
            "predicted_at_lengths_gib": q.peak_bytes / GIB,
            "peak_phase": q.peak_phase,
            "components_gib": {c.name: c.nbytes / GIB for c in q.components()},
            "measured_gib": got.get("peak_rss_gib"),
        }
    out = {
        "config": args.config, "overrides": overrides, "mean_lengths": lengths, "load": os.getloadavg(),
        "processes": rows, "measured": measured,
    }  # fmt: skip
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
