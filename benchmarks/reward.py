"""Reward benchmark: rule scoring of 10,000 GSM8K-style responses, in-process and with the process pool.

The responses mix right answers, wrong answers, no answer, commas and ``$``, and long reasoning whose
answer sits at the end (only the last 300 characters are searched). Prints the seconds of strict and
flexible scoring in-process and with ``--workers`` forked processes (pool start-up included), and
checks that both give the same scores. Target: <= 2 s on a 2-core machine.

    .venv/bin/python benchmarks/reward.py [--n 10000] [--workers 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from verl_core.reward import RuleOptions, score_rules  # noqa: E402

TARGET_S = 2.0


def responses(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` GSM8K-style (response, ground truth) pairs of five kinds, 200-1,200 characters each."""
    rng = random.Random(seed)
    texts, truths = [], []
    for i in range(n):
        answer = rng.randint(-50, 5_000_000)
        steps = "\n".join(
            f"Step {k}: {rng.randint(1, 999)} * {rng.randint(1, 99)} = {rng.randint(1, 99_999)} items"
            for k in range(rng.randint(5, 30))
        )
        kind = i % 5
        if kind == 0:
            tail = f"#### {answer}"  # right
        elif kind == 1:
            tail = f"#### {answer + 1}"  # wrong
        elif kind == 2:
            tail = f"So the total is {answer} dollars."  # no '####'
        elif kind == 3:
            tail = f"#### {answer:,}"  # commas
        else:
            tail = f"That costs ${answer:,}\n#### ${answer}"  # '$' (no strict answer)
        texts.append(f"{steps}\n{tail}")
        truths.append(str(answer))
    return texts, truths


def timed(texts: list[str], truths: list[str], method: str, workers: int) -> tuple[float, list[float]]:
    options = RuleOptions(method, 1.0, 0.0)  # type: ignore[arg-type]
    sources = ["openai/gsm8k"] * len(texts)
    t0 = time.perf_counter()
    out = score_rules(texts, truths, sources, options, num_workers=workers, parallel_min_samples=1)
    return time.perf_counter() - t0, out.scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    texts, truths = responses(args.n)
    print(f"{args.n} responses, mean {sum(map(len, texts)) / len(texts):.0f} characters")
    worst = 0.0
    for method in ("strict", "flexible"):
        s_in, scores_in = timed(texts, truths, method, workers=0)
        s_pool, scores_pool = timed(texts, truths, method, workers=args.workers)
        assert scores_in == scores_pool, "pool and in-process scores differ"
        acc = sum(scores_in) / len(scores_in)
        print(
            f"{method:8s}  in-process {s_in:6.3f} s   pool({args.workers}) {s_pool:6.3f} s   "
            f"mean score {acc:.2f}"
        )
        worst = max(worst, s_in, s_pool)
    print(f"slowest {worst:.3f} s (target <= {TARGET_S} s): {'OK' if worst <= TARGET_S else 'TOO SLOW'}")


if __name__ == "__main__":
    main()
