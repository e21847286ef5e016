"""The LM head and log-probs at a real vocabulary: seconds and peak memory of one log-prob pass and of
one actor update micro-batch (forward + backward), at Qwen2.5-0.5B's geometry with its vocabulary of
151,936 rows (from scratch, no download), CPU.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/lm_head.py --ab --repeats 1   # before/after, ~10 min
    .venv/bin/python benchmarks/lm_head.py --part head --sweep 1024,441,110         # the head alone
    .venv/bin/python benchmarks/lm_head.py --shape quickstart --vocab 327           # the quickstart's

``--part head``: the chunked log-prob computation alone (:func:`verl_core.models.packed.chunked_log_probs`)
on random hidden states ``(P, hidden)`` and a trainable ``(vocab, hidden)`` head, P = ``--samples`` ×
``--response`` positions: a no-grad pass without entropy (old / reference log-probs) and a pass with
the entropy as a metric plus the backward of Σ log-probs (the actor's). ``--part model``: the whole
packed model (:class:`verl_core.models.packed.PackedCausalLM`) on ``--samples`` sequences of
``--prompt`` + ``--response`` tokens: :func:`verl_core.training.ppo_kernels.response_log_probs` under
no-grad, and :func:`verl_core.training.ppo_kernels.actor_loss` (GRPO, KL loss) + backward.

Memory: each measurement's peak resident set above the resident set before it (the process's RSS read
from ``/proc/self/statm`` every millisecond by a thread), so what the pass allocates and frees: logits
chunks, activations, gradients. Seconds: the median of ``--repeats`` after one warm-up. ``--ab``: each
measurement also with the head as it was before issue 37 (:func:`previous_head`: 1,024-token chunks at
any vocabulary, checkpointed chunks), the two alternating in one process.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from verl_core.models import lm_head, packed  # noqa: E402
from verl_core.models.packed import PackedCausalLM, chunked_log_probs  # noqa: E402

# (hidden, layers, heads, kv heads, MLP) of Qwen2.5-0.5B's config.json and of the quickstart's model
SHAPES = {"0.5b": (896, 24, 14, 2, 4864), "quickstart": (128, 2, 4, 2, 256)}
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRSS:
    """The largest RSS while the block runs, minus the RSS at its start (sampled every ``every`` s)."""

    def __init__(self, every: float = 0.001) -> None:
        self.every, self.peak, self.base = every, 0, 0
        self._stop = threading.Event()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.every)

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def grown(self) -> int:
        return self.peak - self.base


@contextmanager
def previous_head() -> Iterator[None]:
    """The LM head as it was before issue 37: chunks of ``chunk_size`` tokens whatever the vocabulary,
    each checkpointed chunk's backward making its own ``(V, H)`` weight gradient, no-grad passes on
    the padded ``(S, R)`` layout (the ``z / 1`` copy at temperature 1 aside)."""
    saved = packed._CHUNK_LOGITS_ELEMENTS, lm_head.fits
    packed._CHUNK_LOGITS_ELEMENTS, lm_head.fits = 2**62, lambda *a: False  # type: ignore[assignment]
    _PADDED.append(True)
    try:
        yield
    finally:
        packed._CHUNK_LOGITS_ELEMENTS, lm_head.fits = saved  # type: ignore[assignment]
        _PADDED.clear()


_PADDED: list[bool] = []  # [True] inside previous_head()


def padded_log_probs(actor: PackedCausalLM, batch: Any) -> torch.Tensor:
    """The no-grad pass before issue 37: the LM head on all S·R positions of the padded layout."""
    out, _ = actor(
        batch.input_ids,
        batch.cu_seqlens,
        with_entropy=False,
        positions=batch.gather_index.flatten(),
        shared=batch.shared,
    )
    return out.log_probs.view(batch.gather_index.shape) * batch.response_mask


def measure(name: str, fn: Callable[[], None], repeats: int, ab: bool = False) -> None:
    """Median seconds and largest RSS growth of ``fn``; ``ab``: also under :func:`previous_head`,
    the two alternating (before, after, before, ...) so that a changing load hits both alike."""
    sides = {"before": previous_head, "after": nullcontext} if ab else {"": nullcontext}
    for ctx in sides.values():
        with ctx():
            fn()  # warm-up
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    grown: dict[str, list[int]] = {k: [] for k in sides}
    for _ in range(repeats):
        for side, ctx in sides.items():
            with ctx(), PeakRSS() as peak:
                t = time.perf_counter()
                fn()
                seconds[side].append(time.perf_counter() - t)
            grown[side].append(peak.grown)
    for side in sides:
        label = f"{name} ({side})" if side else name
        print(
            f"  {label:<61} {statistics.median(seconds[side]):8.3f} s   "
            f"peak +{max(grown[side]) / 2**20:6.0f} MiB"
        )


def head_part(args: argparse.Namespace, hidden: int, chunk: int) -> None:
    torch.manual_seed(0)
    positions = args.samples * args.response
    h = torch.randn(positions, hidden, requires_grad=True)
    weight = (torch.randn(args.vocab, hidden) * 0.02).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (positions,))

    def no_grad() -> None:
        with torch.no_grad():
            chunked_log_probs(h, weight, targets, chunk_size=chunk, with_entropy=False)

    def with_grad() -> None:
        out = chunked_log_probs(h, weight, targets, chunk_size=chunk, with_entropy=True, entropy_grad=False)
        out.log_probs.sum().backward()
        h.grad = weight.grad = None

    print(f"head alone: {positions} positions × vocab {args.vocab:,} × hidden {hidden}, chunk_size={chunk}")
    measure("log-probs, no grad, no entropy (old/ref pass)", no_grad, args.repeats, args.ab)
    measure("log-probs + entropy metric, fwd + bwd (actor)", with_grad, args.repeats, args.ab)


def model_part(args: argparse.Namespace, shape: tuple[int, int, int, int, int]) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from verl_core.algorithms import AggNorm
    from verl_core.training.ppo_kernels import ActorLossSpec, actor_loss, make_ppo_batch, response_log_probs

    hidden, layers, heads, kv, mlp = shape
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=mlp, tie_word_embeddings=True, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    actor = PackedCausalLM(lm)
    n_params = sum(p.numel() for p in lm.parameters())
    g = torch.Generator().manual_seed(1)
    group = 2  # samples per prompt (rollout.n)
    prompts = [
        torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist() for _ in range(args.samples)
    ]
    prompts = [prompts[i - i % group] for i in range(args.samples)]
    # response lengths from R/2 to R: the padded (S, R) layout has ~1/4 padding
    lengths = [args.response // 2 + (i * args.response) // (2 * args.samples) for i in range(args.samples)]
    responses = [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lengths]
    batch = make_ppo_batch(prompts, responses, share_prompts=True)
    real = int(batch.response_mask.sum())
    spec = ActorLossSpec(
        policy_loss="vanilla", loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2,
        clip_ratio_c=3.0, entropy_coeff=0.0, use_kl_loss=True, kl_loss_coef=0.04,
        kl_loss_type="low_var_kl", temperature=1.0,
    )  # fmt: skip
    with torch.no_grad():
        old = response_log_probs(actor, batch)[0]
    adv = torch.randn(batch.response_mask.shape) * batch.response_mask
    norm = AggNorm(num_tokens=float(real), num_seqs=float(args.samples), horizon=float(args.response))

    def log_prob_pass() -> None:
        with torch.no_grad():
            padded_log_probs(actor, batch) if _PADDED else response_log_probs(actor, batch)

    def update_micro_batch() -> None:
        actor_loss(actor, batch, old, adv, old, spec, norm).loss.backward()
        lm.zero_grad(set_to_none=True)

    print(
        f"model: Qwen2 {n_params / 1e6:.1f}M params (hidden {hidden}, {layers} layers, "
        f"vocab {args.vocab:,}); "
        f"{args.samples} samples × ({args.prompt} prompt + ≤ {args.response} response) tokens, "
        f"{real} response tokens in a {tuple(batch.gather_index.shape)} layout"
    )
    measure("old log-prob pass (no grad, no entropy)", log_prob_pass, args.repeats, args.ab)
    measure("actor micro-batch: loss fwd (+ entropy metric) + bwd", update_micro_batch, args.repeats, args.ab)
    if args.steps:
        optimizer_steps(actor, lambda _: actor_loss(actor, batch, old, adv, old, spec, norm).loss, args.steps)


def minor_faults() -> int:
    """Minor page faults of the process so far: each first touch of a fresh 4 KiB page is one."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def optimizer_steps(actor: PackedCausalLM, loss_fn: Callable[[int], torch.Tensor], steps: int) -> None:
    """``steps`` optimizer steps of one micro-batch through :class:`TrainEngine` (AdamW), each split
    into forward, backward, gradient clipping and the AdamW step: seconds and the memory first
    touched (minor page faults × 4 KiB; the kernel zeroes each fresh page)."""
    from verl_core.training.engine import OptimSpec, TrainEngine

    spec = OptimSpec(
        lr=1e-6, weight_decay=0.01, warmup_steps=0, total_steps=steps, scheduler="constant", grad_clip=1.0
    )
    engine = TrainEngine(actor, spec)
    clock: dict[str, float] = defaultdict(float)
    faults: dict[str, int] = defaultdict(int)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            t, f = time.perf_counter(), minor_faults()
            try:
                return fn(*a, **k)
            finally:
                clock[name] += time.perf_counter() - t
                faults[name] += minor_faults() - f

        return run

    warnings.filterwarnings("ignore", message="Seems like `optimizer.step")  # the timer wraps it
    engine.optimizer.step = timed("AdamW step", engine.optimizer.step)  # type: ignore[method-assign]
    engine.strategy.clip_grad_norm = timed("clip grad norm", engine.strategy.clip_grad_norm)  # type: ignore[method-assign]
    print(f"optimizer steps (TrainEngine, AdamW) of that micro-batch, {steps}:")
    for step in range(steps):
        clock.clear()
        faults.clear()
        total = timed("step", engine.step)
        total([0], timed("loss forward", loss_fn))
        clock["backward + rest"] = clock["step"] - sum(v for k, v in clock.items() if k != "step")
        faults["backward + rest"] = faults["step"] - sum(v for k, v in faults.items() if k != "step")
        parts = ", ".join(
            f"{k} {clock[k]:.2f} s ({faults[k] * _PAGE / 2**20:,.0f} MiB first-touched)"
            for k in ("loss forward", "backward + rest", "clip grad norm", "AdamW step")
        )
        print(f"  step {step + 1}: {clock['step']:.2f} s = {parts}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=tuple(SHAPES), default="0.5b")
    p.add_argument("--vocab", type=int, default=151_936, help="LM head rows (Qwen2.5's 151,936)")
    p.add_argument("--part", choices=("head", "model", "all"), default="all")
    p.add_argument("--samples", type=int, default=8, help="sequences of the micro-batch")
    p.add_argument("--prompt", type=int, default=48, help="prompt tokens per sequence")
    p.add_argument("--response", type=int, default=64, help="longest response (tokens)")
    p.add_argument("--sweep", default="1024", help="chunk_size values of --part head, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--ab", action="store_true", help="each measurement also with the previous head, alternating"
    )
    p.add_argument("--steps", type=int, default=0, help="--part model: then this many timed optimizer steps")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); logits per chunk ≤ "
        f"{packed._CHUNK_LOGITS_ELEMENTS:,}, kept for backward ≤ {packed._KEEP_LOGITS_ELEMENTS:,}"
    )
    shape = SHAPES[args.shape]
    if args.part in ("head", "all"):
        for chunk in (int(c) for c in args.sweep.split(",")):
            head_part(args, shape[0], chunk)
    if args.part in ("model", "all"):
        model_part(args, shape)


if __name__ == "__main__":
    main()
