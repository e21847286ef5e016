"""Learning: does the RL phase raise held-out accuracy over the SFT checkpoint? The real pipeline
(``flows.pipeline.rlhf_pipeline``: preprocess → template_pack → SFT → RL → export → eval), once per
(config, seed), each in its own run on a temporary local store, one after the other in this process.

    .venv/bin/python benchmarks/learning.py            # quickstart (PPO) + quickstart_grpo, seeds 1 2 3
    .venv/bin/python benchmarks/learning.py --configs configs/quickstart.yaml --seeds 1
    .venv/bin/python benchmarks/learning.py trainer.total_iterations=30   # overrides for every run
    .venv/bin/python benchmarks/learning.py --tools   # quickstart_tools (multi-turn, calculator), seeds 1 2 3
    .venv/bin/python benchmarks/learning.py --sharpen --seeds 1   # quickstart_sharpen (complete demos)

A seed sets ``data.seed`` (which problems, which held out, shuffling), ``trainer.seed`` (model init,
dropout-free training order) and ``rollout.seed`` (sampling). Accuracy is greedy exact-match on the
held-out split, as the pipeline's validation computes it: iteration 0 is the SFT checkpoint (before any
RL update), the last is after RL. Prints one row per run and the mean/min gain per config (target:
≥ +0.15 for every seed), plus wall time per run (target for ``make quickstart``: ≤ 10 min).

``--tools`` runs ``configs/quickstart_tools.yaml`` and also prints the tool-call rate (share of
sampled responses with at least one tool call, ``multi_turn/tool_call_rate`` of the rollout stages'
summaries) of the first 3 vs the last 3 RL iterations (target: last above first, and the +0.15 gain,
on every seed), and of the greedy held-out validations (SFT checkpoint vs after RL).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from verl_core.env import set_quiet_env  # noqa: E402

set_quiet_env(offline=True)

if TYPE_CHECKING:
    from verl_core.store import ArtifactStore

DEFAULT_CONFIGS = ["configs/quickstart.yaml", "configs/quickstart_grpo.yaml"]
TOOLS_CONFIGS = ["configs/quickstart_tools.yaml"]
SHARPEN_CONFIGS = ["configs/quickstart_sharpen.yaml"]
TOOL_RATE = "multi_turn/tool_call_rate"
TARGET_GAIN = {"quickstart_sharpen": 0.10}  # else 0.15


def pass_at_k_before_after(
    store: ArtifactStore, run_id: str
) -> tuple[int, float, float, float, float] | None:
    """(k, pass@1 of the SFT checkpoint, pass@1 after RL, pass@k SFT, pass@k RL) from the run's
    validation summaries; None when the validations did not sample (eval.k = 1)."""
    from stages.floor.locations import iteration_summaries

    vals = list(iteration_summaries(store, run_id, "val").values())
    ks = [int(key.rsplit("_", 1)[1]) for key in vals[0] if key.startswith("val/pass_at_")] if vals else []
    k = max(ks, default=1)
    if k == 1:
        return None
    first, last = vals[0], vals[-1]
    return (
        k,
        first["val/pass_at_1"],
        last["val/pass_at_1"],
        first[f"val/pass_at_{k}"],
        last[f"val/pass_at_{k}"],
    )


def tool_call_rates(store: ArtifactStore, run_id: str) -> tuple[float, float, float, float]:
    """(mean rate of the first 3 RL iterations' rollouts, of the last 3, greedy validation rate of
    the SFT checkpoint, of the last validation), read from the run's committed stage summaries."""
    from stages.floor.locations import iteration_summaries

    rollouts = [s[TOOL_RATE] for s in iteration_summaries(store, run_id, "rollout").values()]
    vals = [s[f"val/{TOOL_RATE}"] for s in iteration_summaries(store, run_id, "val").values()]
    if len(rollouts) < 6 or not vals:
        raise SystemExit(f"{run_id}: fewer than 6 RL iterations or no validation with multi-turn metrics")
    return statistics.mean(rollouts[:3]), statistics.mean(rollouts[-3:]), vals[0], vals[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=None, help="pipeline configs to compare")
    p.add_argument(
        "--tools", action="store_true", help="the tool-use quickstart; also report tool-call rates"
    )
    p.add_argument("--sharpen", action="store_true", help="quickstart_sharpen (complete demonstrations)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--store", default=None, help="artifact store (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = p.parse_args()

    from flows.pipeline import rlhf_pipeline
    from verl_core.config import load_config
    from verl_core.store import ArtifactStore

    configs = args.configs or (
        TOOLS_CONFIGS if args.tools else SHARPEN_CONFIGS if args.sharpen else DEFAULT_CONFIGS
    )
    root = args.store or tempfile.mkdtemp(prefix="verl-flow-learning-")
    rows: list[tuple[str, int, float, float, float, float]] = []
    tool_rows: list[tuple[str, int, float, float, float, float]] = []
    pass_rows: list[tuple[str, int, int, float, float, float, float]] = []
    for config in configs:
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
            passes = pass_at_k_before_after(ArtifactStore(cfg.store.url), run_id)
            if passes is not None:
                pass_rows.append((Path(config).stem, seed, *passes))
                k, p1_sft, p1_rl, pk_sft, pk_rl = passes
                print(
                    f"{run_id}: pass@1 SFT {p1_sft:.3f} → RL {p1_rl:.3f}; "
                    f"pass@{k} SFT {pk_sft:.3f} → RL {pk_rl:.3f}",
                    flush=True,
                )
            if args.tools:
                rates = tool_call_rates(ArtifactStore(cfg.store.url), run_id)
                tool_rows.append((Path(config).stem, seed, *rates))
                print(
                    f"{run_id}: tool-call rate, rollouts first 3 {rates[0]:.3f} → last 3 {rates[1]:.3f}; "
                    f"greedy validation SFT {rates[2]:.3f} → RL {rates[3]:.3f}",
                    flush=True,
                )

    print(f"\nstore: {root}")
    print(f"{'config':<18} {'seed':>4} {'SFT':>6} {'RL':>6} {'gain':>7} {'wall s':>7}")
    for name, seed, sft, rl, gain, wall in rows:
        print(f"{name:<18} {seed:>4} {sft:>6.3f} {rl:>6.3f} {gain:>+7.3f} {wall:>7.0f}")
    for name in dict.fromkeys(r[0] for r in rows):
        gains = [r[4] for r in rows if r[0] == name]
        target = TARGET_GAIN.get(name, 0.15)
        print(
            f"{name}: gain mean {statistics.mean(gains):+.3f}, min {min(gains):+.3f} over {len(gains)} seeds"
            f" ({'meets' if min(gains) >= target else 'misses'} the +{target:.2f} target)"
        )
    if pass_rows:
        print(
            f"\n{'config':<18} {'seed':>4} {'k':>2} {'p@1 SFT':>7} {'p@1 RL':>6} {'p@k SFT':>7} {'p@k RL':>6}"
        )
        for name, seed, k, p1_sft, p1_rl, pk_sft, pk_rl in pass_rows:
            print(f"{name:<18} {seed:>4} {k:>2} {p1_sft:>7.3f} {p1_rl:>6.3f} {pk_sft:>7.3f} {pk_rl:>6.3f}")
    if tool_rows:
        print(f"\n{'config':<18} {'seed':>4} {'rate first3':>11} {'last3':>6} {'val SFT':>7} {'val RL':>6}")
        for name, seed, first3, last3, val0, val1 in tool_rows:
            print(f"{name:<18} {seed:>4} {first3:>11.3f} {last3:>6.3f} {val0:>7.3f} {val1:>6.3f}")
        rising = all(r[3] > r[2] for r in tool_rows)
        print(f"tool-call rate: last 3 above first 3 on {'every' if rising else 'not every'} seed")


if __name__ == "__main__":
    main()
