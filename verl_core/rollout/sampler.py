"""The HF engine's sampler: per-row seeded token draws, for its own decode loop and inside ``generate``.

A row's token at generation step t is drawn by inverse CDF with the uniform
``counter_uniforms(row_key, t)`` (:mod:`verl_core.seeding`), a pure function of the row's key and the
step: the draw does not depend on the other rows of the batch, so a prompt's samples are the same in
any batch, call or rank. ``check_prompt_keys`` is the contract's key rule, shared by the engines.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from verl_core.rollout.base import SamplingParams
from verl_core.seeding import counter_uniforms

__all__ = ["SampleAndRecord", "TokenSampler", "check_prompt_keys", "sample_inverse_cdf"]


def check_prompt_keys(prompt_keys: Sequence[int] | None, n_prompts: int) -> list[int]:
    """The prompts' sampling keys: ``prompt_keys`` (one int per prompt, distinct), default the prompt's
    index in the call."""
    if prompt_keys is None:
        return list(range(n_prompts))
    keys = [int(k) for k in prompt_keys]
    if len(keys) != n_prompts:
        raise ValueError(f"prompt_keys: {len(keys)} keys for {n_prompts} prompts")
    if len(set(keys)) != len(keys):
        raise ValueError("prompt_keys: keys must be distinct (equal keys would draw equal samples)")
    return keys


class TokenSampler:
    """One decoding step of the HF engine: ``(logits (B, V), step) → (tokens (B, 1), log-probs (B, V))``.

    The log-probs are ``log_softmax(logits / T)`` (the behaviour policy at temperature T, before any
    top-k / top-p truncation, as the trainer computes them). Sampling applies top-k / top-p to the
    scaled logits and draws by inverse CDF (``searchsorted`` of a uniform in the cumulative
    probabilities: cheaper than ``torch.multinomial`` on CPU, the same distribution) with row
    b's uniform ``counter_uniforms(keys, step)[b]``. Greedy (T = 0) takes the argmax and reports
    log-probs at T = 1. ``keys (B,)`` int64 row keys. Both decode paths (the engine's own loop and
    :class:`SampleAndRecord` inside ``generate``) draw through this, so they draw the same tokens.
    """

    def __init__(self, params: SamplingParams, keys: Tensor) -> None:
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.greedy = params.greedy
        self.temperature = 1.0 if params.greedy else params.temperature
        self.warpers: list[Any] = []
        if not params.greedy and params.top_k > 0:
            self.warpers.append(TopKLogitsWarper(top_k=params.top_k))
        if not params.greedy and params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=params.top_p))
        self.keys = keys  # (B,)

    def rows(self, index: Tensor) -> TokenSampler:
        """This sampler for the rows ``index (b,)`` of its batch (their keys)."""
        other = copy.copy(self)
        other.keys = self.keys[index]
        return other

    def __call__(self, logits: Tensor, step: int) -> tuple[Tensor, Tensor]:
        scaled = logits.float() / self.temperature  # (B, V)
        logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V)
        if self.greedy:
            return logits.argmax(-1, keepdim=True), logprobs
        if self.warpers:
            for warp in self.warpers:
                scaled = warp(None, scaled)  # the warpers ignore input_ids
            probs = torch.softmax(scaled, dim=-1)
        else:
            probs = logprobs.exp()
        return sample_inverse_cdf(probs, counter_uniforms(self.keys, step)), logprobs  # (B, 1), (B, V)


class SampleAndRecord:
    """:class:`TokenSampler` as a logits processor, for ``generate`` run in greedy mode (the reference
    decode path): records behaviour log-probs and returns scores whose argmax is the drawn token.

    At every step it receives the raw logits ``(B, V)``, keeps their log-probs and, one step later,
    gathers them at the token that was chosen (by then the last column of ``input_ids``): memory
    stays ``(B, V)`` instead of ``(T_new, B, V)`` with ``output_logits=True``.
    """

    def __init__(self, params: SamplingParams, keys: Tensor) -> None:
        self.sampler = TokenSampler(params, keys)
        self.step = 0  # generation steps sampled so far
        self.last: Tensor | None = None  # (B, V) log-probs of the latest step
        self.recorded: list[Tensor] = []  # per step (B,)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.last is not None:
            self.recorded.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        token, self.last = self.sampler(scores, self.step)  # (B, 1), (B, V)
        self.step += 1
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)

    def finish(self, tokens: Tensor) -> Tensor:
        """Log-probs ``(B, T_new)`` of the generated ``tokens (B, T_new)``."""
        if self.last is not None and tokens.shape[1] > len(self.recorded):
            self.recorded.append(self.last.gather(-1, tokens[:, -1:]).squeeze(-1))
        if len(self.recorded) != tokens.shape[1]:
            raise RuntimeError(f"recorded {len(self.recorded)} steps for {tokens.shape[1]} generated tokens")
        if not self.recorded:
            return tokens.new_zeros(tokens.shape, dtype=torch.float32)
        return torch.stack(self.recorded, dim=1)


def sample_inverse_cdf(probs: Tensor, uniforms: Tensor | None = None) -> Tensor:
    """One token per row of ``probs (B, V)`` (rows need not sum exactly to 1): ``(B, 1)`` indices.

    With ``uniforms (B,)`` in [0, 1) (default: drawn from the global RNG), ``u = uniform · Σp``;
    takes the first index whose cumulative probability exceeds ``u``, so zero-probability tokens
    are never chosen; the rare ``u`` that rounds up to the total falls back
    to the row's most likely token."""
    cdf = probs.cumsum(dim=-1)  # (B, V)
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], device=probs.device)
    u = uniforms.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]  # (B, 1)
    token = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[1] - 1)  # (B, 1)
    impossible = probs.gather(-1, token) <= 0
    return torch.where(impossible, probs.argmax(-1, keepdim=True), token)
