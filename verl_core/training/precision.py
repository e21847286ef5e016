"""bf16 mixed precision for training and no-grad forwards: fp32 master weights, bf16 compute.

Three dtypes, named as verl's ``fsdp_config.mixed_precision``:

* ``param_dtype``: the dtype the forward and backward compute in. The *stored* parameters (the
  master weights the optimizer updates, and its Adam moments) keep their own dtype (``model.dtype``);
* ``reduce_dtype``: the dtype gradients are reduced in across data-parallel ranks (FSDP2's
  reduce-scatter, DeepSpeed's ``communication_data_type``); no reduction happens in one process;
* ``buffer_dtype``: the dtype floating buffers are cast to when the model is placed (FSDP2 does not
  manage buffers, so this is done for every strategy, as FSDP1's ``MixedPrecision(buffer_dtype)``).

How each strategy computes in ``param_dtype`` (:func:`verl_core.training.strategies.build_train_engine`):

* ``single``: ``torch.autocast(device_type, param_dtype)`` around the root module's forward
  (:func:`autocast_forward`); matmuls run in bf16 from the fp32 weights, gradients land in fp32;
* ``fsdp2``: ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` on every ``fully_shard`` call: each
  layer's weights are all-gathered in bf16, the fp32 shards stay the optimizer's;
* ``deepspeed``: its ``bf16`` block (bf16 module, fp32 master partitions in the ZeRO optimizer).

Where fp32 matters, and stays fp32 whatever ``param_dtype`` is (bf16 has an 8-bit mantissa: a
log-prob difference of 1e-3 between old and new policy, the size a PPO ratio lives on, is lost in it):

* logits → log-softmax / entropy: :func:`verl_core.models.packed._chunk_logprobs` casts each chunk's
  logits to fp32 (``.float()``) before the log-sum-exp; the head matmul itself runs in bf16, as verl;
* critic values: :func:`verl_core.models.packed.packed_scores` returns ``.float()``;
* losses, advantages, KL and ratios: computed from those fp32 log-probs/values, outside any bf16 op;
* the optimizer: AdamW over the fp32 master parameters (moments fp32 too), gradients fp32.

HF's Qwen2/Llama RMSNorm and rotary embeddings upcast to fp32 internally, with or without autocast.
Under autocast RoPE hands q and k to attention in fp32 beside a bf16 v; packed attention casts all
three to the compute dtype (:func:`verl_core.models.varlen_sdpa.one_dtype`).

Pure bf16 weights (``model.dtype=bfloat16`` without fp32 masters) lose AdamW steps below their rounding
(≈ 2^-8·|w|): the preflight refuses learning rates below it (``_update_below_rounding`` in
:mod:`verl_core.config.preflight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from verl_core.models.loading import torch_dtype

__all__ = ["MixedPrecision", "autocast_forward", "cast_buffers"]


@dataclass(frozen=True)
class MixedPrecision:
    """Compute, gradient-reduction and buffer dtypes of one model (see the module docstring)."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    buffer_dtype: torch.dtype = torch.float32

    @classmethod
    def from_names(cls, param: str | None, reduce: str, buffer: str) -> MixedPrecision | None:
        """From the config's dtype names; None when ``param`` is None (no mixed precision)."""
        if param is None:
            return None
        return cls(torch_dtype(param), torch_dtype(reduce), torch_dtype(buffer))


def cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating-point buffer of ``model`` to ``dtype`` in place (integer buffers stay)."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                module._buffers[name] = buf.to(dtype)


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> tuple[RemovableHandle, ...]:
    """Run every call of ``model`` (its root forward, with everything it calls) under
    ``torch.autocast(device_type, dtype)``; returns the hook handles (``.remove()`` undoes it).

    Hooks rather than a wrapper module: the state-dict keys, the FSDP units and the callers that read
    ``model.lm`` stay as they are. The exit hook is ``always_call``, so a forward that raises still
    leaves autocast. Backward runs outside autocast (as torch recommends); activation-checkpoint
    recomputation replays the autocast state of the forward it recomputes."""
    contexts: list[torch.autocast] = []

    def enter(_module: nn.Module, _args: Any) -> None:
        ctx = torch.autocast(device_type=device_type, dtype=dtype)
        ctx.__enter__()
        contexts.append(ctx)

    def leave(_module: nn.Module, _args: Any, _output: Any) -> None:
        if contexts:
            contexts.pop().__exit__(None, None, None)

    return (
        model.register_forward_pre_hook(enter),
        model.register_forward_hook(leave, always_call=True),
    )
