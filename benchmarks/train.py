"""Training-step benchmark: packed ("remove padding") vs padded forward+backward, and achieved FLOP/s.

    .venv/bin/python benchmarks/train.py                       # quickstart-size and ~27M models, CPU
    .venv/bin/python benchmarks/train.py --sizes large --device cuda --dtype bfloat16 --large-layers 16

Sequence lengths follow GSM8K: question + solution of ``../shared/data/gsm8k/train.jsonl`` tokenized
with a tokenizer trained like the quickstart's. The same sequences go through both paths:
- padded: batches of ``--batch`` sequences in data order, right-padded to the batch maximum, HF forward
  with an attention mask and the token-mean cross-entropy;
- packed: the same sequences packed into token-budget micro-batches (``PackedCausalLM``, SFT loss).
Prints real (non-pad) tokens/s of each, their ratio (target ≥ 1.5×), and the training step's achieved
FLOP/s (6·params·tokens + 12·layers·hidden·Σ len², the usual non-causal attention count) divided by
the FLOP/s of a plain ``torch.matmul`` measured in the same run (target ≥ 50%).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from verl_core.data.packing import dynamic_micro_batches, pack
from verl_core.data.tokenizer import train_tokenizer
from verl_core.models.loading import ScratchSpec, count_parameters, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM
from verl_core.training.sft import count_loss_tokens, sft_loss

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate)
    "quickstart": (128, 2, 4, 2, 256),
    "large": (512, 8, 8, 4, 1536),
}


def gsm8k_lengths(path: Path, n: int, vocab: int, max_len: int) -> list[list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[: max(n, 2000)]]
    texts = [r["question"] + "\n" + r["answer"] for r in rows]
    tok = train_tokenizer(texts[:2000], vocab)
    ids = [tok.encode(t, add_special_tokens=False)[:max_len] for t in texts[:n]]
    return ids


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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


def bench(args: argparse.Namespace, size: str, seqs: list[list[int]], vocab: int) -> dict[str, float]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hidden, layers, heads, kv, inter = SIZES[size]
    if size == "large" and args.large_layers:
        layers = args.large_layers
    spec = ScratchSpec("qwen2", hidden, layers, heads, kv, inter, 2048)
    lm = init_causal_lm(scratch_config(spec, vocab, eos_token_id=0, pad_token_id=0), seed=0, dtype=args.dtype)
    lm = lm.to(device).train()
    packed = PackedCausalLM(lm)
    params = count_parameters(lm)
    batches = [seqs[i : i + args.batch] for i in range(0, len(seqs), args.batch)][: args.steps + 1]
    real = sum(len(s) for b in batches[1:] for s in b)
    budget = max(args.budget, max(len(s) for s in seqs))

    def timed(fn: Any) -> float:
        fn(batches[0])  # warm-up
        lm.zero_grad(set_to_none=True)
        _sync(device)
        t0 = time.perf_counter()
        for b in batches[1:]:
            fn(b)
            lm.zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - t0

    t_pad = timed(lambda b: padded_step(lm, b, device))
    t_pack = timed(lambda b: packed_step(packed, b, budget, device))
    flops = sum(6 * params * len(s) + 12 * layers * hidden * len(s) ** 2 for b in batches[1:] for s in b)
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
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl")
    p.add_argument("--sizes", nargs="+", default=["quickstart", "large"], choices=list(SIZES))
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
    print(f"device {args.device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}")
    for size in args.sizes:
        r = bench(args, size, seqs, args.vocab)
        print(
            f"{size:>10}: {r['params_M']:.2f}M params | padded {r['padded_tok_s']:,.0f} tok/s "
            f"(waste {100 * r['padding_waste']:.1f}%) | packed {r['packed_tok_s']:,.0f} tok/s | "
            f"packed/padded {r['ratio']:.2f}x (target >= 1.5x) | achieved {r['achieved_tflops']:.3f} TFLOP/s "
            f"vs matmul {r['matmul_tflops']:.3f} TFLOP/s = {100 * r['mfu_vs_matmul']:.0f}% (goal >= 50%)"
        )


if __name__ == "__main__":
    main()
