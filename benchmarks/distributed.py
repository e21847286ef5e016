"""The distributed matrix: every SPMD acceptance check of the distributed issue, run and summarised.

    .venv/bin/python benchmarks/distributed.py            # CPU, gloo, 2 (and 4) processes
    .venv/bin/python benchmarks/distributed.py -k zero3   # a subset (pytest -k expression)

Runs the distributed tests (they launch torchrun themselves) with their figures printed, and prints
one table: each check, its outcome, its wall time, and the figures it measured (loss and weight gaps
against one process, the time a killed rank takes to fail the job). The checks:

    2 ranks vs 1 process, same replayed data   FSDP2, DeepSpeed ZeRO-1/2/3: SFT steps, 3 PPO (GAE, critic)
                                               and 3 GRPO updates (test_dp_equivalence, test_fsdp)
    tensor parallelism                         TP=2 and dp 2 × tp 2 vs 1 process (test_tp)
    full-state checkpoints                     world 2 → 1, 2 → 2, 1 → 2; DeepSpeed resume (test_fsdp*)
    sharded rollout                            2 ranks sample the tokens of one process
    the pipeline on 2 ranks                    one Prefect flow run; a rank killed with SIGKILL (test_spmd)

The figures are the tests' own ``print`` lines (``-s``), so the table and the asserted tolerances come
from the same code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/verl_core/training/test_dp_equivalence.py",
    "tests/verl_core/training/test_fsdp.py",
    "tests/verl_core/training/test_fsdp_checkpoint.py",
    "tests/verl_core/training/test_tp.py",
    "tests/verl_core/runtime/test_ranks.py",
    "tests/stages/test_sharded_rollouts.py",
    "tests/stages/test_weight_sync.py",
    "tests/reliability/test_spmd.py",
]
# a printed figure: a gap, a tolerance, or a time
FIGURE = re.compile(r"(max\|Δ\||relative|absolute|failed .* s after|losses|weights).*\d", re.IGNORECASE)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-k", default=None, help="pytest -k expression selecting checks")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider", "--durations=0", *TESTS]
    if args.k:
        cmd += ["-k", args.k]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    lines = proc.stdout.splitlines()
    durations = {
        m.group(2): float(m.group(1)) for m in (re.match(r"^([\d.]+)s call\s+(\S+)", s) for s in lines) if m
    }
    results: dict[str, tuple[str, list[str]]] = {}  # test id → (outcome, figures)
    current = ""
    for line in lines:  # -v -s: "tests/f.py::test_x <printed output ...>PASSED", output may span lines
        start = re.match(r"^(tests/\S+::\S+)\s?(.*)$", line)
        if start and "s call" not in line:
            current, line = start.group(1), start.group(2)
            results.setdefault(current, ("?", []))
        if not current:
            continue
        outcome = re.search(r"(PASSED|FAILED|SKIPPED|ERROR)\s*$", line)
        text = line[: outcome.start()] if outcome else line
        if FIGURE.search(text):
            results[current][1].append(text.strip()[-150:])
        if outcome:
            results[current] = (outcome.group(1), results[current][1])
            current = ""
    print(f"{'check':<96} {'outcome':<8} {'s':>6}")
    for name, (outcome, figures) in results.items():
        print(f"{name:<96} {outcome:<8} {durations.get(name, float('nan')):>6.1f}")
        for figure in figures:
            print(f"    {figure}")
    print(f"total {wall:.0f} s, pytest exit code {proc.returncode}")
    if proc.returncode:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
        sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
