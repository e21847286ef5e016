"""Learning: does the RL phase raise held-out accuracy over the SFT checkpoint? The real pipeline
(``flows.pipeline.rlhf_pipeline``: preprocess → template_pack → SFT → RL → export → eval), once per
(config, seed), each in its own run on a temporary local store, one after the other in this process.

    .venv/bin/python benchmarks/learning.py            # quickstart (PPO) + quickstart_grpo, seeds 1 2 3
    .venv/bin/python benchmarks/learning.py --configs configs/quickstart.yaml --seeds 1
    .venv/bin/python benchmarks/learning.py trainer.total_iterations=30   # overrides for every run

A seed sets ``data.seed`` (which problems, which held out, shuffling), ``trainer.seed`` (model init,
dropout-free training order) and ``rollout.seed`` (sampling). Accuracy is greedy exact-match on the
held-out split, as the pipeline's validation computes it: iteration 0 is the SFT checkpoint (before any
RL update), the last is after RL. Prints one row per run and the mean/min gain per config (target:
≥ +0.15 for every seed), plus wall time per run (target for ``make quickstart``: ≤ 10 min).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from verl_core.env import set_quiet_env  # noqa: E402

set_quiet_env(offline=True)

DEFAULT_CONFIGS = ["configs/quickstart.yaml", "configs/quickstart_grpo.yaml"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="pipeline configs to compare")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--store", default=None, help="artifact store (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = p.parse_args()

    from flows.pipeline import rlhf_pipeline
    from verl_core.config import load_config

    root = args.store or tempfile.mkdtemp(prefix="verl-flow-learning-")
    rows: list[tuple[str, int, float, float, float, float]] = []
    for config in args.configs:
        for seed in args.seeds:
            overrides = [
                f"store.url={root}",
                f"data.seed={seed}",
                f"trainer.seed={seed}",
                f"rollout.seed={seed}",
                *args.overrides,
            ]
            cfg = load_config(str(REPO / config), overrides)
            run_id = f"learning-{Path(config).stem}-seed{seed}"
            t0 = time.perf_counter()
            result = rlhf_pipeline(config=cfg, run_id=run_id)
            wall = time.perf_counter() - t0
            acc = dict(result.val_accuracy)
            first, last = min(acc), max(acc)
            if first != 0:
                raise SystemExit(f"{run_id}: no validation of the SFT checkpoint (trainer.val_before_train)")
            rows.append((Path(config).stem, seed, acc[first], acc[last], acc[last] - acc[first], wall))
            print(
                f"{run_id}: SFT {acc[first]:.3f} → RL {acc[last]:.3f} ({acc[last] - acc[first]:+.3f}) "
                f"after {last} iterations, {wall:.0f} s",
                flush=True,
            )

    print(f"\nstore: {root}")
    print(f"{'config':<18} {'seed':>4} {'SFT':>6} {'RL':>6} {'gain':>7} {'wall s':>7}")
    for name, seed, sft, rl, gain, wall in rows:
        print(f"{name:<18} {seed:>4} {sft:>6.3f} {rl:>6.3f} {gain:>+7.3f} {wall:>7.0f}")
    for name in dict.fromkeys(r[0] for r in rows):
        gains = [r[4] for r in rows if r[0] == name]
        print(
            f"{name}: gain mean {statistics.mean(gains):+.3f}, min {min(gains):+.3f} over {len(gains)} seeds"
            f" ({'meets' if min(gains) >= 0.15 else 'misses'} the +0.15 target)"
        )


if __name__ == "__main__":
    main()
