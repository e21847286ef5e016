"""One-step off-policy overlap: RL iteration time and held-out accuracy with ``trainer.rollout_ahead``
0 vs 1 on the quickstart (``configs/quickstart.yaml``, ``rollout.share_weights=false`` both: the ahead
rollout needs an engine holding its own weights). Per seed, one SFT checkpoint (preprocess →
template_pack → SFT) shared by the RL loops, then the RL loop once per setting in ``--order``, back to
back in this process (e.g. ``0 1 0``: A/B/A to see the machine's drift), each in its own run id.

    .venv/bin/python benchmarks/overlap.py                      # seed 1, order 0 1
    .venv/bin/python benchmarks/overlap.py --seeds 1 2 3 --order 0 1 0
    .venv/bin/python benchmarks/overlap.py trainer.total_iterations=5   # overrides for every run
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/overlap.py   # one torch thread per side (a busy box)

Iteration time = (RL loop wall − validation seconds) / iterations: the loop's own work, the state's
build (init) included. Accuracy: greedy exact match on the held-out split after the last iteration
(iteration 0 is the SFT checkpoint). On CPU the loop splits torch's threads between the ahead rollout
and the update (half each); a 2-core machine has 1 + 1.
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

from verl_core.runtime.env import set_quiet_env  # noqa: E402

set_quiet_env(offline=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml")
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--order", nargs="+", type=int, default=[0, 1], help="rollout_ahead per RL run")
    p.add_argument("--store", default=None, help="artifact store (default: a temporary directory)")
    p.add_argument("--tag", default="", help="suffix of the RL run ids (new runs beside older ones)")
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = p.parse_args()

    import torch
    from _setup import shared_sft

    from flows.rl import rl_loop
    from verl_core.config import load_config
    from verl_core.runtime.run import RunContext

    root = args.store or tempfile.mkdtemp(prefix="verl-flow-overlap-")
    rows: list[tuple[int, int, float, float, float]] = []
    print(f"torch threads: {torch.get_num_threads()}; store: {root}")
    for seed in args.seeds:
        common = [
            f"store.url={root}", f"data.seed={seed}", f"trainer.seed={seed}", f"rollout.seed={seed}",
            "rollout.share_weights=false", "tracking.enabled=false", *args.overrides,
        ]  # fmt: skip
        base = load_config(str(REPO / args.config), common)
        tp, sft = shared_sft(base, f"overlap-seed{seed}")
        for k, ahead in enumerate(args.order):
            cfg = load_config(str(REPO / args.config), [*common, f"trainer.rollout_ahead={ahead}"])
            ctx = RunContext(run_id=f"overlap-seed{seed}-ahead{ahead}-{k}{args.tag}", store_url=root)
            t0 = time.perf_counter()
            out = rl_loop(ctx, cfg, tp, sft)
            wall = time.perf_counter() - t0
            n = max(out.val_accuracy)
            per_it = (wall - out.timing_s.get("validate", 0.0)) / n
            acc = out.val_accuracy[n]
            rows.append((seed, ahead, per_it, out.val_accuracy.get(0, float("nan")), acc))
            phases = ", ".join(f"{p} {s:.1f}" for p, s in out.timing_s.items())
            print(f"seed {seed} ahead {ahead}: {per_it:.2f} s/iteration, accuracy {acc:.3f} ({phases})")
    print(f"\n{'seed':>4} {'ahead':>5} {'s/iter':>7} {'SFT':>6} {'RL':>6}")
    for seed, ahead, per_it, sft_acc, acc in rows:
        print(f"{seed:>4} {ahead:>5} {per_it:>7.2f} {sft_acc:>6.3f} {acc:>6.3f}")
    for ahead in sorted(set(args.order)):
        mine = [r for r in rows if r[1] == ahead]
        print(
            f"ahead {ahead}: mean {statistics.mean(r[2] for r in mine):.2f} s/iteration, "
            f"accuracy {statistics.mean(r[4] for r in mine):.3f} over {len(mine)} run(s)"
        )


if __name__ == "__main__":
    main()
