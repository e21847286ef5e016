"""Content checks of an engine against the trainer: the engine's log-probs are the model's.

Tolerance: fp32 on both sides; vLLM's CPU kernels and the trainer's packed forward agree to ~5e-7 on
these models (measured), so TOL = 1e-5 leaves room for summation order and nothing else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from verl_core.models.packed import packed_log_probs
from verl_core.rollout import Completion, SamplingParams

TOL = 1e-5


def trainer_log_probs(model: torch.nn.Module, done: Sequence[Completion], temperature: float) -> list[Any]:
    """The trainer's recomputed log-probs of each completion's response tokens (packed forward,
    ``softmax(logits / T)``; T = 0 → 1, as the contract says), one tensor per completion."""
    seqs = [c.prompt_ids + c.response_ids for c in done]
    ids = torch.tensor([t for s in seqs for t in s])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        out, _ = packed_log_probs(model, ids, cu, temperature=temperature or 1.0, with_entropy=False)
    lp = out.log_probs
    # position t predicts token t+1: a response of R tokens after a prompt of P is read at P-1..P+R-2
    return [
        lp[int(cu[i]) + len(c.prompt_ids) - 1 : int(cu[i]) + len(seqs[i]) - 1] for i, c in enumerate(done)
    ]


def max_logprob_gap(model: torch.nn.Module, done: Sequence[Completion], temperature: float) -> float:
    ref = trainer_log_probs(model, done, temperature)
    return max(float((torch.tensor(c.logprobs) - r).abs().max()) for c, r in zip(done, ref, strict=True))


def assert_engine_holds(engine: Any, model: torch.nn.Module, prompts: list[list[int]]) -> None:
    """The engine samples from ``model``'s weights: its greedy and sampled log-probs are the trainer's."""
    for params in (
        SamplingParams(temperature=0, max_new_tokens=12),
        SamplingParams(n=2, max_new_tokens=12, seed=3),
    ):
        done = engine.generate(prompts, params)
        gap = max_logprob_gap(model, done, params.temperature)
        assert gap < TOL, f"engine log-probs differ from the model's by {gap:.2e} (T={params.temperature})"
