"""Data-path benchmark: the whole GSM8K train split through preprocess, template, tokenize and pack.

Uses the same verl_core functions as the preprocess and template_pack stages, with the quickstart
tokenizer settings (a byte-level BPE of model.vocab_size trained on data.tokenizer_train_rows rows),
and prints the seconds of every step and the packing waste next to the waste of plain padded
batches holding the same number of sequences. Targets: <= 10 s in all on a 2-core machine; packed
waste <= 5%.

    .venv/bin/python benchmarks/data.py [path/to/gsm8k/train.jsonl] [--budget 4096]

Without a path it reads the project's 200-row sample (``data/gsm8k/train_sample.jsonl``), which checks
the path end to end; the targets are for the full train split (7,473 rows, openai/gsm8k's
``train.jsonl``), given as the path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from verl_core.runtime.env import set_quiet_env  # noqa: E402

set_quiet_env(offline=True)

from verl_core.config import DataConfig, ModelConfig  # noqa: E402
from verl_core.data import (  # noqa: E402
    CleaningReport,
    TextEncoder,
    chat_format,
    clean_rows,
    get_adapter,
    gsm8k_mapping,
    length_stats,
    packing_waste,
    padded_waste,
    plan_bins,
    tokenize_prompts,
    tokenize_sft,
    train_tokenizer,
)

T = TypeVar("T")


def timed(label: str, times: dict[str, float], fn: Callable[[], T]) -> T:
    start = time.perf_counter()
    out = fn()
    times[label] = time.perf_counter() - start
    print(f"  {label:<28s} {times[label]:6.2f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("path", nargs="?", default=str(REPO / "data" / "gsm8k" / "train_sample.jsonl"))
    parser.add_argument("--budget", type=int, default=4096, help="token budget of a packed bin")
    parser.add_argument("--max-length", type=int, default=1024, help="prompt and response length limit")
    args = parser.parse_args()
    data, model = DataConfig(), ModelConfig()
    times: dict[str, float] = {}
    print(f"GSM8K train from {args.path} (TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM')})")

    # 1. preprocess: read JSONL, clean into verl rows
    report = CleaningReport()
    rows = timed(
        "preprocess (read + clean)",
        times,
        lambda: clean_rows(
            get_adapter("gsm8k").load([args.path], [], _opts()).train,
            gsm8k_mapping(),
            split="train",
            report=report,
        ),
    )
    prompts = [p["prompt"] for p in rows.prompts]
    sft = rows.sft_rows()

    # 2. tokenizer, as the quickstart trains it (every k-th row, at most tokenizer_train_rows rows)
    step = max(1, -(-len(prompts) // data.tokenizer_train_rows))
    texts = [m["content"] for msgs in prompts[::step] for m in msgs] + [r["response"] for r in sft[::step]]
    tok = timed("train tokenizer", times, lambda: train_tokenizer(texts, model.vocab_size))
    fmt = chat_format(tok, "auto")
    encoder = TextEncoder(tok)

    # 3. template + tokenize: RL prompts and SFT rows (prompt encodings shared through the encoder)
    lim = args.max_length
    tp = timed(
        "template + tokenize prompts",
        times,
        lambda: tokenize_prompts(encoder, fmt, prompts, max_length=lim, truncation="error", where="bench"),
    )
    ts = timed(
        "template + tokenize SFT",
        times,
        lambda: tokenize_sft(
            encoder,
            fmt,
            [r["prompt"] for r in sft],
            [r["response"] for r in sft],
            max_prompt_length=lim,
            max_response_length=lim,
            truncation="error",
            where="bench",
        ),
    )

    # 4. pack the SFT rows into token-budget bins
    lengths = [len(ids) for ids in ts.input_ids]
    bins = timed("pack (best-fit decreasing)", times, lambda: plan_bins(lengths, args.budget, "bfd"))
    total = sum(times.values())
    per_batch = round(len(lengths) / len(bins))
    packed, padded = packing_waste(lengths, bins, args.budget), padded_waste(lengths, per_batch)
    print(f"  {'total':<28s} {total:6.2f} s   (target <= 10 s)")
    print(f"rows kept {report.kept} / read {report.read}; dropped {dict(report.dropped) or 'none'}")
    _print_stats("prompt tokens", [len(x) for x in tp.input_ids])
    _print_stats("SFT tokens", lengths)
    print(f"packing: {len(bins)} bins of {args.budget} tokens for {len(lengths)} sequences")
    print(
        f"  packed waste {packed:.2%}   vs padded batches of {per_batch} sequences: {padded:.2%}"
        "   (target packed <= 5%)"
    )


def _print_stats(label: str, lengths: list[int]) -> None:
    s: dict[str, Any] = length_stats(lengths)
    print(
        f"{label}: min {s['min']} mean {s['mean']:.1f} p50 {s['p50']:.0f} p95 {s['p95']:.0f} max {s['max']}"
    )


def _opts() -> Any:
    from verl_core.data import LoadOptions

    return LoadOptions()


if __name__ == "__main__":
    main()
