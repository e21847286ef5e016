"""torch's AdamW, the single-tensor path, with each parameter's ``denom`` written into its own gradient.

``torch.optim.AdamW(foreach=False)`` (the CPU default) computes, per parameter ``p`` with gradient
``g`` and moments ``m``, ``v`` at step ``t`` (decoupled weight decay ``λ``, learning rate ``η``)::

    p ← p·(1 − η·λ)
    m ← lerp(m, g, 1 − β₁)
    v ← v·β₂ + (1 − β₂)·g·g
    denom = sqrt(v) / sqrt(1 − β₂ᵗ) + ε                  ← two fresh tensors of p's size
    p ← p − (η / (1 − β₁ᵗ)) · m / denom

The two temporaries of ``denom`` are allocated and freed once per parameter per step. On CPU a
tensor above glibc's mmap threshold (32 MiB at most) is a fresh mapping every time, and the kernel
zeroes each of its 4 KiB pages on first touch (~1 s per GiB on a 2-core VM); smaller ones come back
from the heap top, which glibc trims again once its free space passes twice that threshold. At
Qwen2.5-0.5B's geometry (the tied 151,936 × 896 embedding alone is 545 MB) that is ~2.6 GB of fresh
pages per step, each step.

:class:`GradScratchAdamW` runs the same operations, in the same order, with the same kernels and
scalars, but writes ``denom`` into ``g`` (``torch.sqrt(v, out=g)``, then ``div_``, ``add_``): ``g``
is dead once ``m`` and ``v`` have read it. Results are bit-identical to ``torch.optim.AdamW``
(tests/verl_core/training/test_adamw.py); the gradients hold ``denom`` after :meth:`step`, so it is
for callers that drop them right after (``zero_grad``), as :class:`~verl_core.training.engine.TrainEngine`
does. Off that path (a closure, AMSGrad, ``maximize``, ``foreach``/``fused``/``capturable``/
``differentiable``, a tensor learning rate, complex, sparse, non-CPU, DTensor or differently-strided
tensors) it is ``torch.optim.AdamW`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def _plain(group: dict[str, Any]) -> bool:
    """Whether ``group`` takes torch's single-tensor AdamW path with float hyper-parameters on CPU."""
    flags = ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable")
    floats = (group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"])
    return (
        not any(group.get(k) for k in flags)
        and group.get("decoupled_weight_decay", True)
        and all(isinstance(x, float | int) for x in floats)
        and all(
            type(p.data) is Tensor and p.device.type == "cpu" and not torch.is_complex(p)
            for p in group["params"]
        )  # plain CPU tensors: a DTensor shard (FSDP2, tensor parallel) takes torch's own step
    )


class GradScratchAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step computes ``denom`` in the gradient's storage (module
    docstring); same constructor, state and ``state_dict``."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None or not all(_plain(g) for g in self.param_groups):
            return super().step(closure)
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            exp_avgs: list[Tensor] = []
            exp_avg_sqs: list[Tensor] = []
            steps: list[Tensor] = []
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for p, g, m, v, step_t in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
                step_t += 1
                if wd != 0:
                    p.mul_(1 - lr * wd)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                step = step_t.item()
                step_size = lr / (1 - beta1**step)
                bias_correction2_sqrt = (1 - beta2**step) ** 0.5
                scratch = g.stride() == v.stride() and g.dtype == v.dtype and not g.is_sparse
                denom = torch.sqrt(v, out=g) if scratch else v.sqrt()
                denom.div_(bias_correction2_sqrt).add_(eps)
                p.addcdiv_(m, denom, value=-step_size)
        return None
