"""Micro-batch kernels of the PPO update on packed rollouts: the batch layout, response log-probs and
values, the actor and critic losses of one micro-batch (:mod:`verl_core.training.ppo` runs the iteration).

Samples (prompt + response) are packed without padding for the forward pass; everything the
algorithms need (log-probs, values, advantages, masks) is laid out per response token as padded
``(S, R)`` tensors, R the longest response in the batch. ``gather_index[s, j]`` is the packed position
whose next-token prediction is response token j of sample s (``cu_seqlens[s] + P_s − 1 + j``), so

    response_log_probs[s, j] = log π(y_{s,j} | prompt_s, y_{s,<j}) = packed_log_probs[gather_index[s, j]]

and the critic's value of the state before token j is ``values[gather_index[s, j]]`` (verl's
``values[:, -R-1:-1]``). Each loss is a micro-batch's share of its mini-batch loss (``norm``: the
mini-batch's :class:`AggNorm`), so the shares sum to the mini-batch loss.

With ``share_prompts`` the n samples of a prompt group in one micro-batch run their prompt through
the model once (:class:`~verl_core.models.attention.SharedPrompts`): the layout above (``input_ids``,
``gather_index``) still describes the full sequences; the forward computes the N stored tokens (each
prompt once, every response) and attention sees the full sequences. At the quickstart's geometry (8
samples of ~30 prompt + ~20 response tokens) that is ~190 tokens per group instead of ~400.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from verl_core.algorithms import (
    AggNorm,
    compute_kl_loss,
    compute_value_loss,
    entropy_bonus,
    get_policy_loss,
    masked_mean,
)
from verl_core.models.attention import SharedPrompts, take
from verl_core.models.packed import PackedCausalLM, PackedScoreModel, TokenLogProbs


class PPOBatch(NamedTuple):
    """S packed samples.

    input_ids     (N,)    prompt_s ⧺ response_s for every s, concatenated
    cu_seqlens    (S+1,)  int32 offsets of the samples
    gather_index  (S, R)  packed position predicting response token j of sample s (0 where padded)
    response_mask (S, R)  1.0 on real response tokens
    shared        samples with the same prompt store it once in the forward passes
                  (:class:`~verl_core.models.attention.SharedPrompts`), or None
    """

    input_ids: Tensor
    cu_seqlens: Tensor
    gather_index: Tensor
    response_mask: Tensor
    shared: SharedPrompts | None = None

    def to(self, device: torch.device | str) -> PPOBatch:
        shared = None if self.shared is None else SharedPrompts(*(t.to(device) for t in self.shared))
        return PPOBatch(
            self.input_ids.to(device),
            self.cu_seqlens.to(device),
            self.gather_index.to(device),
            self.response_mask.to(device),
            shared,
        )


def make_ppo_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    loss_masks: Sequence[Tensor] | None = None,
    share_prompts: bool = False,
) -> PPOBatch:
    """Pack ``prompts[s] + responses[s]``. Every prompt needs ≥ 1 token (something predicts the first
    response token); an empty response gives an all-zero mask row. ``loss_masks[s]`` (``(≥ len(r_s),)``,
    1 on tokens the policy generated) zeroes the mask where the policy did not generate the token.
    ``share_prompts``: samples whose prompt equals an earlier sample's store it once (``shared``;
    None when no two prompts are equal)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
    r_max = max((len(r) for r in responses), default=0)
    ids: list[int] = []
    starts = [0]
    expand: list[int] = []  # stored position of each packed token
    unique: list[int] = []  # packed position of each stored token
    stored: dict[tuple[int, ...], int] = {}  # prompt → stored position of its first token
    gather = torch.zeros(len(prompts), max(r_max, 1), dtype=torch.long)
    mask = torch.zeros(len(prompts), max(r_max, 1))
    for s, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not p:
            raise ValueError(f"sample {s} has an empty prompt")
        first = starts[-1] + len(p) - 1  # position predicting response token 0
        gather[s, : len(r)] = torch.arange(first, first + len(r))
        mask[s, : len(r)] = 1.0 if loss_masks is None else loss_masks[s][: len(r)].float()
        if share_prompts:
            key = tuple(p)
            if key not in stored:
                stored[key] = len(unique)
                unique.extend(range(starts[-1], starts[-1] + len(p)))
            expand.extend(range(stored[key], stored[key] + len(p)))
            expand.extend(range(len(unique), len(unique) + len(r)))
            unique.extend(range(starts[-1] + len(p), starts[-1] + len(p) + len(r)))
        ids.extend(p)
        ids.extend(r)
        starts.append(len(ids))
    shared = None
    if len(unique) < len(expand):
        shared = SharedPrompts(torch.tensor(expand, dtype=torch.long), torch.tensor(unique, dtype=torch.long))
    return PPOBatch(
        torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.int32), gather, mask, shared
    )


LogProbModel = Callable[..., tuple[TokenLogProbs, Tensor]]
"""A packed causal LM: ``(input_ids (N,), cu_seqlens (S+1,), temperature=, with_entropy=,
entropy_grad=, positions=, shared=)`` → ``(TokenLogProbs, has_target)`` (:class:`PackedCausalLM`, or
:class:`AdapterDisabledPolicy`)."""


def response_log_probs(
    model: LogProbModel,
    batch: PPOBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """``(S, R)`` log-probs of the response tokens (and entropies, differentiable if ``entropy_grad``)
    under ``model``, 0 where masked. The LM head runs on the S·R gathered positions only; without
    autograd on the real response tokens only (the padded layout can be mostly padding: at a vocabulary
    of 151,936 each padded row is a 600 KB row of logits). Each row's log-prob is computed alone, so
    the values are the same; under autograd the padded rows stay, since dropping them would reorder
    the sums of the head's weight gradient (other float rounding)."""
    shape = batch.gather_index.shape
    real = None if torch.is_grad_enabled() else batch.response_mask.flatten() > 0  # (S·R,)
    positions = batch.gather_index.flatten()  # (S·R,)
    out, _ = model(
        batch.input_ids,
        batch.cu_seqlens,
        temperature=temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        positions=positions if real is None else positions[real],  # (S·R,) or (real tokens,)
        shared=batch.shared,
    )
    logp = _unpack(out.log_probs, real).view(shape) * batch.response_mask
    ent = None if out.entropy is None else _unpack(out.entropy, real).view(shape) * batch.response_mask
    return logp, ent


def _unpack(values: Tensor, real: Tensor | None) -> Tensor:
    """``values`` of the ``real`` positions (``(real.sum(),)``) laid out on all ``(S·R,)`` of them,
    0 elsewhere; ``real`` None: ``values`` already are."""
    if real is None:
        return values
    return torch.zeros(real.shape, dtype=values.dtype, device=values.device).masked_scatter_(real, values)


def response_values(critic: PackedScoreModel, batch: PPOBatch) -> Tensor:
    """``(S, R)`` values V(state before response token j), 0 where masked."""
    values = critic(batch.input_ids, batch.cu_seqlens, shared=batch.shared)  # (N,)
    return take(values, batch.gather_index) * batch.response_mask


@dataclass(frozen=True)
class ActorLossSpec:
    policy_loss: str
    loss_agg_mode: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    temperature: float


class ActorLoss(NamedTuple):
    """loss: the micro-batch's share of the mini-batch loss (scalar); metrics: its logged values;
    log_probs: ``(S, R)`` log π_θ of the response tokens (detached, 0 where masked)."""

    loss: Tensor
    metrics: dict[str, float]
    log_probs: Tensor


def actor_loss(
    model: LogProbModel,
    batch: PPOBatch,
    old_log_probs: Tensor | None,
    advantages: Tensor,
    ref_log_probs: Tensor | None,
    spec: ActorLossSpec,
    norm: AggNorm,
    rollout_is_weights: Tensor | None = None,
) -> ActorLoss:
    """L = agg(w·L_pg) − c_H·H̄ + β·KL(π‖π_ref) for one micro-batch; per-token inputs ``(S, R)``;
    w the rollout correction's importance weights (None: 1), the mask ``batch.response_mask``.
    ``old_log_probs`` None: the model *is* π_old (its first step on these samples), so
    π_old = sg(π_θ) (stop-gradient): ratio 1, the same loss and gradient without a second forward."""
    mask = batch.response_mask
    # without an entropy bonus the entropy is a metric only: no backward through it
    log_prob, entropy = response_log_probs(
        model, batch, temperature=spec.temperature, with_entropy=True, entropy_grad=spec.entropy_coeff > 0
    )
    pg = get_policy_loss(spec.policy_loss)(
        log_prob=log_prob,
        old_log_prob=log_prob.detach() if old_log_probs is None else old_log_probs,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=spec.loss_agg_mode,
        clip_ratio_low=spec.clip_ratio_low,
        clip_ratio_high=spec.clip_ratio_high,
        clip_ratio_c=spec.clip_ratio_c,
        norm=norm,
        rollout_is_weights=rollout_is_weights,
    )
    loss = pg.loss
    metrics = {
        "actor/pg_loss": float(pg.loss.detach()),
        "actor/pg_clipfrac": float(pg.stats.pg_clipfrac),
        "actor/pg_clipfrac_lower": float(pg.stats.pg_clipfrac_lower),
        "actor/ppo_kl": float(pg.stats.ppo_kl),
    }
    assert entropy is not None
    bonus = entropy_bonus(entropy, mask, spec.entropy_coeff, spec.loss_agg_mode, norm)
    loss = loss + bonus.loss
    metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
    if spec.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("actor.use_kl_loss needs reference log-probs")
        kl = compute_kl_loss(
            log_prob=log_prob,
            ref_log_prob=ref_log_probs,
            response_mask=mask,
            kl_loss_coef=spec.kl_loss_coef,
            kl_loss_type=spec.kl_loss_type,
            loss_agg_mode=spec.loss_agg_mode,
            norm=norm,
        )
        loss = loss + kl.loss
        metrics["actor/kl_loss"] = float(kl.kl_loss)
    return ActorLoss(loss, metrics, log_prob.detach())


def critic_loss(
    critic: PackedScoreModel,
    batch: PPOBatch,
    old_values: Tensor,
    returns: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str,
    norm: AggNorm,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss for one micro-batch; inputs ``(S, R)``."""
    values = response_values(critic, batch)
    out = compute_value_loss(
        values=values,
        old_values=old_values,
        returns=returns,
        response_mask=batch.response_mask,
        cliprange_value=cliprange_value,
        loss_agg_mode=loss_agg_mode,
        norm=norm,
    )
    return out.loss, {
        "critic/vf_loss": float(out.loss.detach()),
        "critic/vf_clipfrac": float(out.stats.vf_clipfrac),
        "critic/vpred_mean": float(masked_mean(values.detach(), batch.response_mask)),
    }


class AdapterDisabledPolicy:
    """The reference of a LoRA actor: the actor's own packed model with its adapters disabled."""

    def __init__(self, actor: PackedCausalLM, peft_model: nn.Module) -> None:
        self.actor, self.peft_model = actor, peft_model

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[TokenLogProbs, Tensor]:
        with self.peft_model.disable_adapter():  # type: ignore[operator]
            return self.actor(*args, **kwargs)
