"""Supervised fine-tuning: the loss on packed batches (next-token NLL over assistant tokens only) and
the loop (:func:`sft_train`: optimizer steps over a token-row split, periodic validation,
checkpoints through a callback, resume from one), plain PyTorch: the stage reads and commits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from verl_core.data.packing import PackedBatch, pack
from verl_core.models.checkpoint import rng_state, set_rng_state
from verl_core.models.packed import PackedCausalLM
from verl_core.runtime.ranks import rank0_to_main
from verl_core.seeding import derive_seed
from verl_core.training.data_parallel import DPView, MicroBatch, dp_micro_batches, dp_view
from verl_core.training.strategies import full_weights


def count_loss_tokens(loss_masks: Sequence[Sequence[int]]) -> int:
    """Tokens that are prediction targets in the loss: masked tokens except each sequence's first
    (nothing predicts the first token)."""
    return sum(int(sum(m[1:])) for m in loss_masks)


class SFTStepPlan(NamedTuple):
    """One SFT optimizer step on this rank.

    micro_batches    this rank's micro-batches, padded to the count every rank runs (a padding
                     micro-batch has weight 0: multiply its loss by ``mb.weight``)
    num_loss_tokens  loss targets of the whole step, all ranks: the normaliser of :func:`sft_loss`
    """

    micro_batches: list[MicroBatch]
    num_loss_tokens: int


def sft_step_plan(
    rows: Sequence[int],
    lengths: Sequence[int],
    loss_masks: Sequence[Sequence[int]],
    budget: int,
    dp: DPView,
) -> SFTStepPlan:
    """Split one optimizer step's ``rows`` (the same on every rank) over the data-parallel ranks
    (Karmarkar–Karp on ``lengths``) into token-budget micro-batches, padded to a common count so every
    rank makes the same FSDP2/ZeRO-3 collective calls; ``lengths[i]``, ``loss_masks[i]``: row i's."""
    micro = dp_micro_batches(rows, lengths, budget, dp)
    return SFTStepPlan(micro, count_loss_tokens([loss_masks[i] for i in rows]))


def target_mask(loss_mask: Tensor, has_target: Tensor) -> Tensor:
    """``(N,)`` float mask of positions whose *target* (the next token) is a loss token.

    Position t predicts token t+1, so it counts when ``loss_mask[t+1] == 1`` and t is not the last
    token of its sequence (``has_target``)."""
    shifted = torch.zeros_like(loss_mask, dtype=torch.float32)
    shifted[:-1] = loss_mask[1:].float()
    return shifted * has_target.float()


def sft_loss(
    model: PackedCausalLM,
    input_ids: Tensor,
    cu_seqlens: Tensor,
    loss_mask: Tensor,
    *,
    num_loss_tokens: int,
) -> tuple[Tensor, Tensor]:
    """Σ_t −log p(x_{t+1} | x_≤t) over loss targets / ``num_loss_tokens`` (the *mini-batch* count, so
    micro-batch losses sum to the mini-batch token-mean).

    Args: ``input_ids (N,)``, ``cu_seqlens (S+1,)``, ``loss_mask (N,)`` (1 on assistant tokens).
    Returns ``(loss, summed nll (detached))``."""
    out, has_target = model(input_ids, cu_seqlens, with_entropy=False)
    mask = target_mask(loss_mask, has_target)
    nll_sum = -(out.log_probs * mask).sum()
    return nll_sum / max(1, num_loss_tokens), nll_sum.detach()


# --------------------------------------------------------------------------------------------------
# The SFT loop

Rows = tuple[list[list[int]], list[list[int]]]
"""A split of token rows: each row's token ids and its loss mask (1 on assistant tokens)."""

History = list[tuple[int, str, float]]
"""Every logged value of a run: (optimizer step, metric name, value)."""

Micro = tuple[PackedBatch, float]  # a packed micro-batch and its loss weight (0: padding)


@dataclass(frozen=True)
class SFTLoopSpec:
    """The plan of one SFT run (the stage builds it from ``sft.*`` and ``trainer.seed``, where the
    defaults live)."""

    total_steps: int  # optimizer steps of the whole run
    steps_per_epoch: int  # ⌈rows / batch_size⌉
    batch_size: int  # rows per optimizer step
    token_budget: int  # tokens per packed micro-batch
    val_every: int  # validation every that many steps (0: only before and after)
    log_every: int  # metrics logged every that many steps, and at the last
    save_every: int  # a checkpoint every that many steps (0: none)
    seed: int  # the row order of every epoch


class SFTCheckpoint(NamedTuple):
    """What a checkpoint holds, gathered from every rank (the full tensors on the main rank).

    weights        the policy's full state dict (None on ranks that do not hold it)
    trainer_state  ``engine`` (optimizer, scheduler, step), ``rng``, ``step``, ``history``: what
                   :func:`resume` reads back
    """

    step: int
    weights: dict[str, Tensor] | None
    trainer_state: dict[str, Any]


class SFTRun(NamedTuple):
    """completed: optimizer steps done (below ``total_steps`` when the rows ran out); history: every
    logged value, the resumed run's included; started: ``time.perf_counter()`` when this call began."""

    completed: int
    history: History
    started: float


def batch_rows(n: int, batch_size: int, step: int, steps_per_epoch: int, seed: int) -> list[int]:
    """Rows of optimizer step ``step``: a permutation per epoch seeded by (seed, epoch), so the order
    depends only on the step (a resumed run sees exactly the same batches)."""
    epoch, k = divmod(step, steps_per_epoch)
    g = torch.Generator().manual_seed(derive_seed("sft_order", seed, epoch))
    order = torch.randperm(n, generator=g).tolist()
    return order[k * batch_size : (k + 1) * batch_size]


def sft_train(
    engine: Any,
    train: Rows,
    val: Rows,
    spec: SFTLoopSpec,
    *,
    device: torch.device,
    start: int = 0,
    history: History | None = None,
    on_log: Callable[[int, dict[str, float]], None] | None = None,
    on_checkpoint: Callable[[SFTCheckpoint], None] | None = None,
    on_step: Callable[[float], None] | None = None,
) -> SFTRun:
    """SFT steps ``start`` … ``spec.total_steps − 1`` of ``engine`` (a train engine of a
    :class:`PackedCausalLM`) on ``train``: each step's rows (:func:`batch_rows`) in token-budget
    micro-batches, the token-mean NLL of assistant tokens (:func:`sft_loss`). The validation loss
    before step 0 (a fresh run) and every ``spec.val_every`` steps goes into the history.

    Every rank of an SPMD job calls it with the same arguments (each trains on its share of a step).
    Callbacks, on every rank: ``on_log(step, metrics)`` every ``spec.log_every`` steps and at the last;
    ``on_checkpoint`` every ``spec.save_every`` steps but the last (its :class:`SFTCheckpoint` is
    gathered); ``on_step(loss)`` after each step."""
    history = list(history or [])
    tokens, started = 0, time.perf_counter()
    if start == 0:
        history.append((0, "sft/val_loss", val_loss(engine, val, spec.token_budget, device)))
    completed, total = start, spec.total_steps
    for step in range(start, total):
        rows = batch_rows(len(train[0]), spec.batch_size, step, spec.steps_per_epoch, spec.seed)
        if not rows:  # the loader ran out before the plan: the caller's step count check fails
            break
        micro, n_loss = _micro_batches(engine, train, rows, spec.token_budget, device)
        stats = engine.step(micro, _loss_fn(engine, n_loss), where="sft")
        tokens += sum(mb.num_tokens for mb, weight in micro if weight)  # this rank's, padding not
        metrics = {"sft/loss": stats.loss, "sft/grad_norm": stats.grad_norm, "sft/lr": stats.lr}
        done = completed = step + 1
        if spec.val_every and done % spec.val_every == 0 and done < total:
            metrics["sft/val_loss"] = val_loss(engine, val, spec.token_budget, device)
        if done % spec.log_every == 0 or done == total:
            metrics["perf/sft_tokens_per_s"] = tokens / max(1e-9, time.perf_counter() - started)
            if on_log is not None:
                on_log(done, metrics)
        history.extend((done, k, float(v)) for k, v in metrics.items())
        if spec.save_every and done % spec.save_every == 0 and done < total and on_checkpoint is not None:
            on_checkpoint(checkpoint(engine, done, history))
        if on_step is not None:
            on_step(stats.loss)
    return SFTRun(completed, history, started)


def checkpoint(engine: Any, step: int, history: History) -> SFTCheckpoint:
    """The checkpoint after step ``step``: weights and optimizer state gathered (collectives when
    sharded: every rank calls it), this process's RNG state."""
    weights = full_weights(engine, "lm.")  # every rank: collectives when sharded
    optimizer = rank0_to_main(engine.state_dict())  # every rank: the full state lands on global rank 0
    trainer_state = {"engine": optimizer, "rng": rng_state(), "step": step, "history": history}
    return SFTCheckpoint(step, weights, trainer_state)


def resume(engine: Any, trainer_state: dict[str, Any]) -> tuple[int, History]:
    """Load a checkpoint's ``trainer_state`` into ``engine`` and the RNG; the step to start from and
    the history so far."""
    engine.load_state_dict(trainer_state["engine"])
    set_rng_state(trainer_state["rng"])
    history = [(int(a), str(b), float(c)) for a, b, c in trainer_state["history"]]
    return int(trainer_state["step"]), history


@torch.no_grad()
def val_loss(engine: Any, val: Rows, budget: int, device: torch.device) -> float:
    """Token-mean NLL over the whole validation split (each rank its share, summed over ranks);
    NaN without rows."""
    if not val[0]:
        return float("nan")
    engine.model.eval()
    micro, n_loss = _micro_batches(engine, val, list(range(len(val[0]))), budget, device)
    loss = _loss_fn(engine, n_loss)
    total = torch.tensor([sum(float(loss(mb)) for mb in micro)], dtype=torch.float64)
    group = dp_view(engine).group
    if group is not None:
        dist.all_reduce(total, group=group)
    return float(total)


def _loss_fn(engine: Any, num_loss_tokens: int) -> Callable[[Micro], Tensor]:
    """The micro-batch loss: its share of the step's token-mean NLL (all ranks), times its weight."""
    model = engine.model

    def loss(micro: Micro) -> Tensor:
        mb, weight = micro
        assert mb.loss_mask is not None
        nll = sft_loss(model, mb.input_ids, mb.cu_seqlens, mb.loss_mask, num_loss_tokens=num_loss_tokens)[0]
        return nll * weight

    return loss


def _micro_batches(
    engine: Any, data: Rows, rows: Sequence[int], budget: int, device: torch.device
) -> tuple[list[Micro], int]:
    """This rank's packed micro-batches of the step ``rows`` (its data-parallel share, padded to the
    count every rank runs: a padding micro-batch has weight 0) and the step's loss-token count."""
    ids, masks = data
    plan = sft_step_plan(rows, [len(x) for x in ids], masks, budget, dp_view(engine))
    micro = [
        (
            pack([ids[r] for r in mb.rows], seq_index=mb.rows, loss_masks=[masks[r] for r in mb.rows]).to(
                device
            ),
            mb.weight,
        )
        for mb in plan.micro_batches
    ]
    return micro, plan.num_loss_tokens
