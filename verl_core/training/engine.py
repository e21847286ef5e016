"""One training-step engine for SFT and PPO: micro-batches with gradient accumulation, AdamW,
warm-up + cosine/constant schedule, gradient clipping, a NaN/Inf guard, pluggable strategies.

Loss convention (see :mod:`verl_core.algorithms.aggregation`): the loss function returns each
micro-batch's share of the mini-batch loss (normalised by the *whole* mini-batch's token or sequence
count), so the micro-batch losses sum to the mini-batch loss and the accumulated gradient equals the
mini-batch gradient whatever the split (1×8 == 8×1). Under data parallelism the normaliser is global
(all data-parallel ranks) and gradients are averaged over those ranks by the strategy, so each rank's
loss is multiplied by ``dp_size`` (with tensor parallelism, ``world_size / tp_size``).

Checkpoints (:meth:`TrainEngine.state_dict`) hold the *full* optimizer state keyed by parameter name,
whatever the strategy: a checkpoint from any world size loads at any other, one process included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_core.errors import VerlFlowError
from verl_core.runtime.watchdog import beat
from verl_core.training.adamw import GradScratchAdamW
from verl_core.training.distributed import full_optimizer_state, load_full_optimizer_state

T = TypeVar("T")


class NonFiniteError(VerlFlowError):
    """A loss or gradient became NaN/Inf; raised before the optimizer step (nothing is committed)."""


ADAM_BETAS = (0.9, 0.999)  # AdamW's β₁, β₂ (not a config knob)


@dataclass(frozen=True)
class OptimSpec:
    """AdamW and its LR schedule (:func:`lr_schedule`); the stage builds it from the config, where the
    defaults live."""

    lr: float  # peak learning rate
    weight_decay: float  # on matrices only (:func:`param_groups`)
    warmup_steps: int
    total_steps: int
    scheduler: str  # "constant" | "cosine"
    grad_clip: float  # global gradient norm


class StepStats(NamedTuple):
    loss: float  # the mini-batch loss (sum of micro-batch losses, over all data-parallel ranks)
    grad_norm: float  # global gradient norm before clipping
    lr: float  # learning rate used for this step
    micro_batches: int


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, scheduler: str) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Linear warm-up: (step+1)/warmup for step < warmup. Then ``constant`` → 1, or ``cosine`` →
    ½(1 + cos(π·progress)), progress = (step − warmup)/(total − warmup) ∈ [0, 1]."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler == "constant":
        return 1.0
    if scheduler != "cosine":
        raise ValueError(f"unknown lr scheduler {scheduler!r}; valid: constant, cosine")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return 0.5 * (1 + math.cos(math.pi * progress))


def lr_schedule(optimizer: torch.optim.Optimizer, spec: OptimSpec) -> torch.optim.lr_scheduler.LambdaLR:
    """``optimizer``'s LR schedule: the peak ``spec.lr`` × :func:`lr_multiplier` of the step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            s, warmup_steps=spec.warmup_steps, total_steps=spec.total_steps, scheduler=spec.scheduler
        ),
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable params in two groups: matrices decay, biases and norm weights (1-D) do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Strategy(Protocol):
    """How a model is placed, how gradients are combined across ranks, how the norm is clipped.

    ``rank``/``world_size``: this process among all; ``dp_rank``/``dp_size``/``dp_group``: among the
    data-parallel ranks whose gradients are averaged (``dp_size = world_size / tp_size``; group None
    in one process)."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup | None
    tp_size: int

    def prepare(self, model: nn.Module) -> nn.Module: ...
    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> Tensor: ...
    def all_reduce_sum(self, value: float) -> float: ...


class SingleStrategy:
    """One process, CPU or one GPU."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1
    dp_group: dist.ProcessGroup | None = None
    tp_size = 1

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def all_reduce_sum(self, value: float) -> float:
        return value


class TrainEngine:
    """Owns the optimizer and scheduler of one model and runs optimizer steps."""

    def __init__(self, model: nn.Module, spec: OptimSpec, strategy: Strategy | None = None) -> None:
        self.strategy: Strategy = strategy or SingleStrategy()
        self.model = self.strategy.prepare(model)
        self.spec = spec
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise VerlFlowError("the model has no trainable parameters")
        # torch's AdamW, bit for bit, its ``denom`` computed in the gradients this engine drops after
        # each step (no fresh pages per step: verl_core.training.adamw)
        self.optimizer: torch.optim.AdamW = GradScratchAdamW(
            param_groups(self.model, spec.weight_decay), lr=spec.lr, betas=ADAM_BETAS, foreach=False
        )
        self.scheduler = lr_schedule(self.optimizer, spec)
        self.global_step = 0

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        """All ranks of the job (1 in one process)."""
        return self.strategy.world_size

    @property
    def dp_rank(self) -> int:
        return self.strategy.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks whose gradients this engine averages (1 in one process)."""
        return self.strategy.dp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.strategy.dp_group

    def step(
        self, micro_batches: Sequence[T], loss_fn: Callable[[T], Tensor], *, where: str = "train"
    ) -> StepStats:
        """Accumulate gradients over ``micro_batches`` and take one optimizer step.

        ``loss_fn(mb)`` returns the micro-batch's share of the mini-batch loss (a scalar tensor). A
        non-finite loss or gradient norm raises :class:`NonFiniteError` naming ``where``, the step and
        the tensor, before the optimizer changes any weight."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i, mb in enumerate(micro_batches):
            loss = loss_fn(mb)
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(
                    f"{where}: loss is {loss.item()} at step {self.global_step}, micro-batch {i}"
                )
            (loss * self.strategy.dp_size).backward()  # the strategy averages over dp_size ranks
            total += float(loss.detach())
            beat(optimizer_step=self.global_step + 1, micro_batch=f"{i + 1}/{len(micro_batches)}")
        grad_norm = self.strategy.clip_grad_norm(self.params, self.spec.grad_clip)
        if not torch.isfinite(grad_norm):
            bad = [
                n
                for n, p in self.model.named_parameters()
                if p.grad is not None and not p.grad.isfinite().all()
            ]
            self.optimizer.zero_grad(set_to_none=True)
            named = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            raise NonFiniteError(
                f"{where}: grad_norm is {grad_norm.item()} at step {self.global_step} "
                f"(non-finite gradient of {named or 'no single parameter'})"
            )
        lr = float(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        # freed now, not at the next step's start: kept, they would stay resident (the trainable
        # weights' size again) through generation and the log-prob passes until the next update
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.global_step += 1
        return StepStats(self.strategy.all_reduce_sum(total), float(grad_norm), lr, len(micro_batches))

    def state_dict(self) -> dict[str, Any]:
        """Optimizer (full, on CPU, keyed by parameter name), scheduler and step. Every rank calls it;
        under torch.distributed the optimizer tensors reach rank 0 only (the rank that saves)."""
        return {
            "optimizer": full_optimizer_state(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "global_step": self.global_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` saved at any world size; every rank calls it with the same state."""
        load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.global_step = int(state["global_step"])

    def use_spec_lr(self) -> None:
        """After :meth:`load_state_dict` of another run's state (a fork): keep its moments and step but
        schedule this engine's ``spec.lr`` (a loaded scheduler state holds the saved base rates). The
        current rate is the schedule's at the loaded step, ``lr = base · λ(step)``: for an unchanged
        ``spec.lr`` exactly the loaded value."""
        s = self.scheduler
        s.base_lrs = [self.spec.lr for _ in s.base_lrs]
        lrs = [base * fn(s.last_epoch) for fn, base in zip(s.lr_lambdas, s.base_lrs, strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["initial_lr"], group["lr"] = self.spec.lr, lr
        s._last_lr = lrs  # what get_last_lr() reports until the next step


def batched(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """Consecutive slices of ``items`` of length ``size`` (the last may be shorter)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
