"""Lineage operations benchmark: what rescoring and replaying a run cost next to making it.

1. runs the pipeline for ``--config`` (default the quickstart: 20 RL iterations) in a fresh store;
2. rescores every stored rollout of it with the same reward settings (``verl-flow rescore``) and prints
   the rescore's wall time and scoring time against the run's own rollout + reward time of those
   iterations (the rollout and reward stages' seconds, from their manifests);
3. replays iterations ``--from``.. with unchanged settings (``verl-flow replay``, export and eval off)
   and prints its RL-loop and wall time against the original run's seconds of the same iterations
   (``iteration_s`` of the run's report), then checks that the replay's final checkpoint policy has
   the parent's sha256 (a replay with unchanged settings is exact).

    .venv/bin/python benchmarks/lineage_ops.py [--config configs/quickstart.yaml] [--store DIR]
        [--from 10] [overrides ...]
    # a quick check of the script itself (seconds of work, not the figures):
    .venv/bin/python benchmarks/lineage_ops.py --from 1 trainer.total_iterations=2 trainer.save_freq=1 \\
        sft.max_steps=2 eval.max_samples=4 data.arithmetic_train_size=64

Prints the figures and exits 1 if the replay's final policy differs from the parent's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stages.floor.locations import ckpt_stage  # noqa: E402
from verl_core.config import load_config  # noqa: E402
from verl_core.store import ArtifactStore  # noqa: E402


def iteration_seconds(store: ArtifactStore, run_id: str) -> dict[int, float]:
    """``{iteration: seconds}`` of the run's report (``iteration_s``: rollout, reward, update, validation)."""
    report = store.committed(run_id, "report")
    if report is None:
        raise SystemExit(f"run {run_id!r} has no report")
    series = json.loads(store.read_bytes(report, "metrics.json"))["series"]["iteration_s"]
    return {int(k): float(v) for k, v in series.items()}


def policy_sha(store: ArtifactStore, run_id: str, iteration: int) -> str:
    m = store.committed(run_id, ckpt_stage(iteration))
    if m is None:
        raise SystemExit(f"run {run_id!r} has no checkpoint at iteration {iteration}")
    return m.file("policy/model.safetensors").sha256


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--store", default=None, help="artifact store (default: a new temporary directory)")
    p.add_argument("--from", dest="start", type=int, default=10, help="replay from this checkpoint")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the original run")
    a = p.parse_args()
    store_url = a.store or tempfile.mkdtemp(prefix="lineage-ops-")
    cfg = load_config(a.config, [*a.overrides, f"store.url={store_url}"])
    total = cfg.trainer.total_iterations
    if not 0 < a.start < total:
        raise SystemExit(f"--from: {a.start}, expected 0 < it < trainer.total_iterations ({total})")
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env()
    from flows.pipeline import rlhf_pipeline
    from flows.replay import replay_flow
    from flows.rescore import rescore_flow

    store = ArtifactStore(store_url)
    t0 = time.perf_counter()
    run = rlhf_pipeline(config=cfg)
    run_wall = time.perf_counter() - t0
    run_id = run.run_id

    rescored = rescore_flow(run_id=run_id, name="same", store_url=store_url)
    r = rescored.report

    t0 = time.perf_counter()
    replay_id = f"{run_id}-replay{a.start}-bench"
    replay = replay_flow(
        run_id=run_id, start_iteration=a.start, overrides=["export.enable=false"], new_run_id=replay_id,
        store_url=store_url,
    )  # fmt: skip
    replay_wall = time.perf_counter() - t0
    original = iteration_seconds(store, run_id)
    replayed = iteration_seconds(store, replay_id)
    span = range(a.start, total)
    orig_s = sum(original.get(i, 0.0) for i in span)
    replay_iter_s = sum(replayed.get(i, 0.0) for i in span)
    same = policy_sha(store, run_id, total) == policy_sha(store, replay_id, total)

    print(f"\nstore {store_url}; run {run_id} ({total} RL iterations, {run_wall:.1f} s wall)")
    print(f"rescore 'same' (every stored rollout: {len(rescored.stages)} stages, same reward settings)")
    print(f"  rescore wall time                         {rescored.wall_s:8.1f} s")
    print(f"  scoring (all tables / training rollouts)  {r.scoring_s:8.1f} s / {r.train_scoring_s:.1f} s")
    print(f"  the run's own rollout + reward time       {r.original_s:8.1f} s")
    print(f"  agreement with the stored rewards         {r.total.agreement:8.4f}")
    print(f"replay of iterations {a.start}..{total - 1} ({len(span)} iterations, unchanged settings)")
    print(f"  replay wall time (whole flow)             {replay_wall:8.1f} s")
    rl_s = replay.timing_s.get("rl", 0.0)
    print(f"  replay RL loop / its iterations           {rl_s:8.1f} s / {replay_iter_s:.1f} s")
    print(f"  the original run's same iterations        {orig_s:8.1f} s")
    print(f"  final policy sha256 equals the parent's   {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
