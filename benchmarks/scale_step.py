"""One RL training micro-batch of ``benchmarks/scale.py``'s workload outside the pipeline: how long its
kernels take alone, at each size, and with memory held by another process.

    .venv/bin/python benchmarks/scale_step.py --sizes 135m 0.5b
    .venv/bin/python benchmarks/scale_step.py --sizes 0.5b --hold-gib 13      # ~20 GiB resident in all
    .venv/bin/python benchmarks/scale_step.py --sizes 0.5b --profile          # torch.profiler top ops

The model is built from scratch at the size's geometry (``scale.SIZES``, tied embeddings, fp32, SDPA
attention, :class:`verl_core.models.packed.PackedCausalLM`); the micro-batch is ``--samples`` samples
of ``--prompt`` + ``--response`` random tokens, two per prompt with the prompt stored once, as the
pipeline's actor micro-batches are. Timed: the forward (``response_log_probs`` with entropies, the
loss) and the backward, best of ``--repeats`` after one warm-up, with the pages each first touches
(``ru_minflt``); the gradients are dropped between steps as the optimizer's ``zero_grad`` does. FLOPs
as the cost model counts them (:func:`verl_core.planning.cost.forward_flops`: 3× for forward +
backward). ``--hold-gib``: a child process fills and holds that many GiB for the whole measurement,
as the reference, the AdamW moments and the vLLM engine hold memory beside the update in the pipeline.
Figures: ``benchmarks/RESULTS.md`` (issue 37).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _hw import held_memory  # noqa: E402  (benchmarks/ is the script's folder)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["135m", "0.5b"], help="scale.py sizes (not qs)")
    p.add_argument("--samples", type=int, default=4, help="samples in the micro-batch (two per prompt)")
    p.add_argument("--prompt", type=int, default=36, help="prompt tokens")
    p.add_argument("--response", type=int, default=32, help="response tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--hold-gib", type=float, default=0.0, help="GiB a child process holds meanwhile")
    p.add_argument("--profile", action="store_true", help="torch.profiler's top ops of one more step")
    return p.parse_args()


def build(size: str, args: argparse.Namespace) -> tuple[Any, Any, float]:
    """The packed model of ``size``, the micro-batch and its forward + backward FLOPs."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.scale import SIZES
    from verl_core.models.packed import PackedCausalLM
    from verl_core.planning.cost import forward_flops
    from verl_core.planning.geometry import Geometry
    from verl_core.training.ppo_kernels import make_ppo_batch

    s = SIZES[size]
    cfg = Qwen2Config(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"], intermediate_size=s["mlp"], vocab_size=s["vocab"],
        tie_word_embeddings=True, max_position_embeddings=4 * (args.prompt + args.response),
    )  # fmt: skip
    model = PackedCausalLM(Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa"))
    gen = torch.Generator().manual_seed(0)
    groups = [
        torch.randint(0, s["vocab"], (args.prompt,), generator=gen).tolist() for _ in range(args.samples // 2)
    ]
    prompts = [p for p in groups for _ in range(2)]
    responses = [torch.randint(0, s["vocab"], (args.response,), generator=gen).tolist() for _ in prompts]
    batch = make_ppo_batch(prompts, responses, share_prompts=True)
    g = Geometry(
        "qwen2",
        s["hidden"],
        s["layers"],
        s["heads"],
        s["kv"],
        s["hidden"] // s["heads"],
        s["mlp"],
        s["vocab"],
    )
    stored = len(groups) * args.prompt + len(prompts) * args.response
    ell = args.prompt + args.response
    return model, batch, 3 * forward_flops(g, stored, len(prompts) * args.response, len(prompts), ell)


def timed_step(model: Any, batch: Any) -> tuple[float, float, float, float]:
    """Seconds of the forward (log-probs, entropies, the loss) and the backward, and the GB of pages
    each first touches; the gradients dropped after."""
    from verl_core.training.ppo_kernels import response_log_probs

    t0, f0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logp, _ = response_log_probs(model, batch, with_entropy=True, entropy_grad=False)
    loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
    t1, f1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    loss.backward()
    t2, f2 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for p in model.parameters():
        p.grad = None
    return t1 - t0, t2 - t1, (f1 - f0) * 4096 / 1e9, (f2 - f1) * 4096 / 1e9


def main() -> None:
    args = parse_args()
    import torch

    from verl_core.planning.cost import measure_cpu_matmul_rate

    torch.set_num_threads(args.threads)
    with held_memory(args.hold_gib):
        rate = measure_cpu_matmul_rate()
        print(f"matmul rate {rate / 1e9:.0f} GFLOP/s, {args.hold_gib:g} GiB held by another process")
        for size in args.sizes:
            model, batch, flops = build(size, args)
            timed_step(model, batch)  # warm-up
            runs = [timed_step(model, batch) for _ in range(args.repeats)]
            fwd, bwd, fwd_gb, bwd_gb = min(runs, key=lambda x: x[0] + x[1])
            achieved = flops / (fwd + bwd)
            print(
                f"{size}: forward {fwd:.3f} s ({fwd_gb:.2f} GB first touched), backward {bwd:.3f} s "
                f"({bwd_gb:.2f} GB), step {fwd + bwd:.3f} s, {flops / 1e9:.0f} GFLOP: "
                f"{achieved / 1e9:.0f} GFLOP/s ({100 * achieved / rate:.0f}% of the rate)",
                flush=True,
            )
            if args.profile:
                from torch.profiler import profile

                with profile() as prof:
                    timed_step(model, batch)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
