"""Training-step benchmark: packed ("remove padding") vs padded forward+backward, and achieved FLOP/s.

    .venv/bin/python benchmarks/train.py                       # quickstart-size and ~27M models, CPU
    .venv/bin/python benchmarks/train.py --sizes large --device cuda --dtype bfloat16 --large-layers 16
    .venv/bin/python benchmarks/train.py --shape 0.5b --device cuda --dtype bfloat16 --packed-attention all
    .venv/bin/python benchmarks/train.py --shape quickstart --profile     # torch.profiler + host syncs

``--shape`` picks one geometry (``0.5b``: Qwen2.5-0.5B's hidden 896, 24 layers, 14/2 heads, MLP 4864,
built from scratch with vocab 32,000, not 151,936: the token ids come from the small GSM8K tokenizer,
so only the embedding/LM-head size would change, and 32k keeps it within a 24 GiB CPU box).
``--packed-attention`` runs the packed path with one backend of ``model.packed_attention`` (``all``:
each one that can run on the device, for training or, if it has no backward there, skipped).
``--compile`` runs the packed path with ``model.torch_compile``'s compiled decoder layers (compiled
during the untimed warm-up step; the padded path stays eager). ``--profile`` prints torch.profiler's
top ops by self time for one packed training step and one no-grad log-prob pass, and the
host-synchronisation count of each: calls of ``Tensor.item``,
``Tensor.tolist``, ``int()/float()/bool()`` of a tensor (each one a device→host sync on CUDA; on CUDA
``torch.cuda.set_sync_debug_mode`` reports them as well).

Sequence lengths follow GSM8K: question + solution of ``data/gsm8k/train_sample.jsonl`` (or ``--data``)
tokenized with a tokenizer trained like the quickstart's. The same sequences go through both paths:
- padded: batches of ``--batch`` sequences in data order, right-padded to the batch maximum, HF forward
  with an attention mask and the token-mean cross-entropy;
- packed: the same sequences packed into token-budget micro-batches (``PackedCausalLM``, SFT loss).
Prints real (non-pad) tokens/s of each, their ratio (target ≥ 1.5×), and the training step's achieved
FLOP/s (``_hw.train_flops``: 6·N·tokens + 6·layers·d·Σ len², N the Linear weights, causal
attention) divided by the FLOP/s of a plain ``torch.matmul`` measured in the same run (target ≥ 50%).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _hw import (
    attention_width,
    device_name,
    matmul_flops,
    matmul_params,
    of_dense_peak,
    peak_memory_bytes,
    reset_peak_memory,
    synchronize,
    train_flops,
)

from verl_core.data.packing import dynamic_micro_batches, pack
from verl_core.data.tokenizer import train_tokenizer
from verl_core.models.attention import PACKED_ATTENTION
from verl_core.models.loading import ScratchSpec, count_parameters, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM
from verl_core.models.varlen_sdpa import AUTO_ORDER, select_backend
from verl_core.training.sft import count_loss_tokens, sft_loss

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate)
    "quickstart": (128, 2, 4, 2, 256),
    "large": (512, 8, 8, 4, 1536),
    "0.5b": (896, 24, 14, 2, 4864),  # Qwen2.5-0.5B geometry (vocab 32,000 here, see the docstring)
}
SHAPE_VOCAB = {"0.5b": 32000}


def gsm8k_lengths(path: Path, n: int, vocab: int, max_len: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[: max(n, 2000)]]
    texts = [r["question"] + "\n" + r["answer"] for r in rows]
    tok = train_tokenizer(texts[:2000], vocab)
    ids = [tok.encode(t, add_special_tokens=False)[:max_len] for t in texts[:n]]
    return ids


def padded_step(model: Any, seqs: list[list[int]], device: torch.device) -> None:
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100).backward()


def packed_step(model: PackedCausalLM, seqs: list[list[int]], budget: int, device: torch.device) -> None:
    masks = [[0] + [1] * (len(s) - 1) for s in seqs]
    n = count_loss_tokens(masks)
    for part in dynamic_micro_batches([len(s) for s in seqs], budget):
        mb = pack([seqs[i] for i in part], loss_masks=[masks[i] for i in part]).to(device)
        assert mb.loss_mask is not None
        sft_loss(model, mb.input_ids, mb.cu_seqlens, mb.loss_mask, num_loss_tokens=n)[0].backward()


@contextlib.contextmanager
def count_host_syncs() -> Iterator[collections.Counter[str]]:
    """Counts ``Tensor.item/tolist/__int__/__float__/__bool__`` calls by caller (file:line): each is a
    device→host synchronisation when the tensor lives on a GPU."""
    counts: collections.Counter[str] = collections.Counter()
    names = ("item", "tolist", "__int__", "__float__", "__bool__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def wrap(name: str, fn: Any) -> Any:
        def counted(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            frame = sys._getframe(1)
            counts[f"{name} {Path(frame.f_code.co_filename).name}:{frame.f_lineno}"] += 1
            return fn(self, *a, **k)

        return counted

    for n, fn in saved.items():
        setattr(torch.Tensor, n, wrap(n, fn))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def profile(packed: PackedCausalLM, seqs: list[list[int]], budget: int, device: torch.device) -> None:
    """torch.profiler top ops (self time) and host-sync counts: one packed training step (fwd+bwd of
    the SFT loss) and one no-grad log-prob pass (no entropy, as old/ref log-probs run)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    part = next(iter(dynamic_micro_batches([len(s) for s in seqs], budget)))
    mb = pack([seqs[i] for i in part]).to(device)

    def logprobs() -> None:
        with torch.no_grad():
            packed(mb.input_ids, mb.cu_seqlens, with_entropy=False)

    for title, fn in (
        ("training step", lambda: packed_step(packed, seqs, budget, device)),
        ("log-probs", logprobs),
    ):
        fn()  # warm-up
        synchronize(device)
        with count_host_syncs() as syncs, torch_profile(activities=acts) as prof:
            fn()
            synchronize(device)
        print(
            f"\n--- profile: {title} ({len(seqs) if title == 'training step' else len(part)} sequences) ---"
        )
        print(prof.key_averages().table(sort_by=sort, row_limit=15))
        print(
            f"host syncs: {sum(syncs.values())} — " + ", ".join(f"{k} ×{v}" for k, v in syncs.most_common(8))
        )
        packed.lm.zero_grad(set_to_none=True)


def bench(
    args: argparse.Namespace, size: str, seqs: list[list[int]], vocab: int, attention: str = "auto"
) -> dict[str, float]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    vocab = SHAPE_VOCAB.get(size, vocab)
    hidden, layers, heads, kv, inter = SIZES[size]
    if size == "large" and args.large_layers:
        layers = args.large_layers
    spec = ScratchSpec("qwen2", hidden, layers, heads, kv, inter, 2048)
    lm = init_causal_lm(scratch_config(spec, vocab, eos_token_id=0, pad_token_id=0), seed=0, dtype=args.dtype)
    lm = lm.to(device).train()
    packed = PackedCausalLM(lm, attention=attention, compile_layers=args.compile)
    if args.profile:
        profile(packed, seqs[: args.batch], max(args.budget, max(len(s) for s in seqs)), device)
    reset_peak_memory(device)
    params = count_parameters(lm)
    batches = [seqs[i : i + args.batch] for i in range(0, len(seqs), args.batch)][: args.steps + 1]
    real = sum(len(s) for b in batches[1:] for s in b)
    budget = max(args.budget, max(len(s) for s in seqs))

    def timed(fn: Any) -> float:
        fn(batches[0])  # warm-up
        lm.zero_grad(set_to_none=True)
        synchronize(device)
        t0 = time.perf_counter()
        for b in batches[1:]:
            fn(b)
            lm.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - t0

    t_pad = timed(lambda b: padded_step(lm, b, device))
    mem_pad = peak_memory_bytes(device) / 2**30
    reset_peak_memory(device)
    t_pack = timed(lambda b: packed_step(packed, b, budget, device))
    mem_pack = peak_memory_bytes(device) / 2**30
    n_layers, width = attention_width(lm.config)
    flops = train_flops(matmul_params(lm), [len(s) for b in batches[1:] for s in b], n_layers, width)
    peak = matmul_flops(device, dtype)
    padded_tokens = sum(len(b) * max(len(s) for s in b) for b in batches[1:])
    return {
        "params_M": params / 1e6,
        "real_tokens": real,
        "padding_waste": 1 - real / padded_tokens,
        "padded_tok_s": real / t_pad,
        "packed_tok_s": real / t_pack,
        "ratio": t_pad / t_pack,
        "achieved_tflops": flops / t_pack / 1e12,
        "matmul_tflops": peak / 1e12,
        "mfu_vs_matmul": flops / t_pack / peak,
        "peak_gib_padded": mem_pad,
        "peak_gib_packed": mem_pack,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--data",
        type=Path,
        default=REPO / "data" / "gsm8k" / "train_sample.jsonl",
        help="GSM8K JSONL (question, answer); default the project's 200-row sample, enough for the default "
        "--batch × (--steps + 1) sequences; the full train split also trains the tokenizer on 2,000 rows",
    )
    p.add_argument("--sizes", nargs="+", default=["quickstart", "large"], choices=list(SIZES))
    p.add_argument("--shape", choices=list(SIZES), help="one geometry (overrides --sizes)")
    p.add_argument(
        "--packed-attention",
        default="auto",
        choices=["auto", "all", *PACKED_ATTENTION.names()],
        help="packed attention backend (model.packed_attention); all: every one that trains on the device",
    )
    p.add_argument("--profile", action="store_true", help="torch.profiler top ops + host-sync counts")
    p.add_argument(
        "--compile",
        action="store_true",
        help="packed path with model.torch_compile's compiled decoder layers (compiled in the warm-up step)",
    )
    p.add_argument("--batch", type=int, default=16, help="sequences per step (both paths)")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")
    p.add_argument("--budget", type=int, default=4096, help="packed micro-batch token budget")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--large-layers", type=int, default=0, help="override the large model's layer count")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    seqs = gsm8k_lengths(args.data, args.batch * (args.steps + 1), args.vocab, args.max_len)
    lengths = [len(s) for s in seqs]
    print(f"GSM8K sequences: {len(seqs)}, length mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)}")
    device = torch.device(args.device)
    print(
        f"device {args.device} ({device_name(device)}), dtype {args.dtype}, torch threads "
        f"{torch.get_num_threads()}; FLOPs = 6·N·tokens + 6·layers·d·Σ len² per step (_hw: N = Linear "
        "weights, d = query heads × head dim, causal attention)"
    )
    backends = [args.packed_attention]
    if args.packed_attention == "all":
        dtype = getattr(torch, args.dtype)
        backends = []
        for name in (*AUTO_ORDER.get(device.type, ()), *PACKED_ATTENTION.names()):
            if name in backends:
                continue
            try:
                select_backend(name, device, dtype, needs_grad=True)
                backends.append(name)
            except RuntimeError as e:
                print(f"  skipped {name}: {e}")
    for size, backend in [(z, b) for z in ([args.shape] if args.shape else args.sizes) for b in backends]:
        r = bench(args, size, seqs, args.vocab, backend)
        print(
            f"{size:>10} [{backend}]: {r['params_M']:.2f}M params | peak {r['peak_gib_padded']:.2f} / "
            f"{r['peak_gib_packed']:.2f} GiB (padded / packed) | padded {r['padded_tok_s']:,.0f} tok/s "
            f"(waste {100 * r['padding_waste']:.1f}%) | packed {r['packed_tok_s']:,.0f} tok/s | "
            f"packed/padded {r['ratio']:.2f}x (target >= 1.5x) | achieved {r['achieved_tflops']:.3f} TFLOP/s "
            f"vs matmul {r['matmul_tflops']:.3f} TFLOP/s = {100 * r['mfu_vs_matmul']:.0f}% (goal >= 50%)"
            f"{of_dense_peak(r['achieved_tflops'] * 1e12, device)}"
        )


if __name__ == "__main__":
    main()
