"""DeepSpeed ZeRO-1/2/3 training engine with the same ``step`` contract as :class:`TrainEngine`.

Optional: needs ``pip install 'verl-flow[deepspeed]'`` and a torchrun launch. DeepSpeed owns
the optimizer partitioning, gradient clipping and the step; we keep torch's AdamW (no JIT-compiled
DeepSpeed Adam), our LR schedule, and the loss convention of :mod:`verl_core.training.engine`
(micro-batch losses are shares of the mini-batch loss, so ``scale_wrt_gas=False``; each rank's loss
is multiplied by the world size because DeepSpeed averages gradients over ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from verl_core.doctor import require
from verl_core.training.engine import NonFiniteError, OptimSpec, StepStats, lr_multiplier, param_groups
from verl_core.watchdog import beat

T = TypeVar("T")


def deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


class DeepSpeedTrainEngine:
    """ZeRO-``zero_stage`` over every rank of the default process group."""

    def __init__(self, model: nn.Module, spec: OptimSpec, *, zero_stage: int = 2, bf16: bool = False) -> None:
        require({"deepspeed": "actor.strategy: 'deepspeed'"})  # installed, its torch pin met
        import deepspeed
        import torch.distributed as dist

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.world_size = dist.get_world_size()
        self.spec = spec
        optimizer = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=spec.betas)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: lr_multiplier(
                s, warmup_steps=spec.warmup_steps, total_steps=spec.total_steps,
                scheduler=spec.scheduler, min_ratio=spec.min_lr_ratio,
            ),
        )  # fmt: skip
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": spec.grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": bf16},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,
        }
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.model: nn.Module = self.engine
        self.global_step = 0

    def step(
        self, micro_batches: Sequence[T], loss_fn: Callable[[T], Tensor], *, where: str = "train"
    ) -> StepStats:
        """Accumulate over ``micro_batches`` and step (see :meth:`TrainEngine.step`). A non-finite
        loss raises before the step; a non-finite gradient norm is caught by DeepSpeed's overflow check
        in mixed precision and raises here after it (the step is then skipped by DeepSpeed)."""
        self.engine.train()
        total = 0.0
        for i, mb in enumerate(micro_batches):
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            loss = loss_fn(mb)
            if not torch.isfinite(loss):
                raise NonFiniteError(
                    f"{where}: loss is {loss.item()} at step {self.global_step}, micro-batch {i}"
                )
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            total += float(loss.detach())
            beat(optimizer_step=self.global_step + 1, micro_batch=f"{i + 1}/{len(micro_batches)}")
        lr = float(self.scheduler.get_last_lr()[0])
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        if grad_norm is not None and not torch.isfinite(torch.tensor(norm)):
            raise NonFiniteError(f"{where}: grad_norm is {norm} at step {self.global_step}")
        self.global_step += 1
        t = torch.tensor([total], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return StepStats(float(t.item()), norm, lr, len(micro_batches))

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("use self.engine.save_checkpoint(dir) for DeepSpeed (sharded) state")
