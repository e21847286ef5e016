"""Build a training engine, or place a frozen model, for a strategy named in the config.

``single`` (one process, CPU or one GPU), ``fsdp2`` (``fully_shard`` per decoder layer, then the
root; tensor parallelism and CPU offload optional) and ``deepspeed`` (ZeRO stage 1/2/3). The
distributed strategies need the default process group (a torchrun launch); the stage unpacks the
config into the arguments and names its section in ``role`` so that errors point at the field.

``mixed_precision`` (:class:`~verl_core.training.precision.MixedPrecision`, None: compute in the
parameters' own dtype) is applied the way each strategy does it: autocast around the root forward
(``single``), FSDP2's ``MixedPrecisionPolicy``, DeepSpeed's ``bf16`` block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from verl_core.errors import ConfigError
from verl_core.training.engine import OptimSpec, SingleStrategy, TrainEngine
from verl_core.training.precision import MixedPrecision, autocast_forward, cast_buffers

__all__ = ["FROZEN_STRATEGIES", "TRAIN_STRATEGIES", "build_train_engine", "full_weights", "prepare_frozen"]

TRAIN_STRATEGIES = ("single", "fsdp2", "deepspeed")
FROZEN_STRATEGIES = ("single", "fsdp2")


def build_train_engine(
    model: nn.Module,
    spec: OptimSpec,
    *,
    strategy: str,
    device: torch.device | str,
    zero_stage: int = 2,
    param_offload: bool = False,
    tp_size: int = 1,
    mixed_precision: MixedPrecision | None = None,
    role: str = "actor",
) -> Any:
    """A :class:`TrainEngine` (``single``, ``fsdp2``) or a ``DeepSpeedTrainEngine`` (``deepspeed``)
    for ``model``; all three have the same ``step`` / ``model`` / ``global_step`` surface and a
    data-parallel view (:func:`verl_core.training.data_parallel.dp_view`).

    ``role`` ("actor", "critic") names the config section in errors. Raises :class:`ConfigError` for
    an unknown strategy or an impossible combination."""
    device = torch.device(device)
    _check(role, strategy, TRAIN_STRATEGIES, zero_stage=zero_stage, tp_size=tp_size)
    if strategy == "single":
        if param_offload:
            raise ConfigError(f"{role}.param_offload: true needs {role}.strategy fsdp2 or deepspeed")
        _single_precision(model, device, mixed_precision)
        return TrainEngine(model, spec, SingleStrategy(device))
    if mixed_precision is not None:
        cast_buffers(model, mixed_precision.buffer_dtype)
    if strategy == "fsdp2":
        return TrainEngine(model, spec, _fsdp2(device, mixed_precision, tp_size, param_offload))
    from verl_core.training.deepspeed_engine import DeepSpeedTrainEngine

    if param_offload:
        raise ConfigError(f"{role}.param_offload: not supported with {role}.strategy deepspeed (use fsdp2)")
    return DeepSpeedTrainEngine(model, spec, zero_stage=zero_stage, mixed_precision=mixed_precision)


def prepare_frozen(
    model: nn.Module,
    strategy: str,
    device: torch.device | str,
    param_offload: bool = False,
    *,
    mixed_precision: MixedPrecision | None = None,
    role: str = "ref",
) -> nn.Module:
    """``model`` frozen (no gradients, eval mode) and placed for no-grad forwards: on ``device``
    (``single``) or FSDP2-sharded over every rank (``fsdp2``: each forward all-gathers the weights, so
    every rank must run the same number of forwards; ``ppo_iteration`` does). ``mixed_precision``:
    its forwards compute in ``param_dtype`` (autocast, or FSDP2's all-gather dtype)."""
    device = torch.device(device)
    _check(role, strategy, FROZEN_STRATEGIES)
    model.eval().requires_grad_(False)
    if strategy == "single":
        if param_offload:
            raise ConfigError(f"{role}.param_offload: true needs {role}.strategy fsdp2")
        _single_precision(model, device, mixed_precision)
        return model.to(device)
    if mixed_precision is not None:
        cast_buffers(model, mixed_precision.buffer_dtype)
    return _fsdp2(device, mixed_precision, 1, param_offload).prepare(model)


def _single_precision(model: nn.Module, device: torch.device, mp: MixedPrecision | None) -> None:
    """One process: buffers cast, forwards under autocast to ``mp.param_dtype`` (nothing when None,
    or when the parameters already are in that dtype: then there is nothing to mix)."""
    if mp is None:
        return
    cast_buffers(model, mp.buffer_dtype)
    if any(p.is_floating_point() and p.dtype != mp.param_dtype for p in model.parameters()):
        autocast_forward(model, device.type, mp.param_dtype)


def _check(
    role: str, strategy: str, valid: tuple[str, ...], *, zero_stage: int = 2, tp_size: int = 1
) -> None:
    if strategy not in valid:
        raise ConfigError(f"{role}.strategy: unknown strategy {strategy!r}; valid: {', '.join(valid)}")
    if strategy != "single" and not dist.is_initialized():
        raise ConfigError(
            f"{role}.strategy: {strategy} needs torch.distributed initialised: launch with "
            "trainer.n_gpus_per_node > 1 or under torchrun"
        )
    if strategy == "deepspeed" and zero_stage not in (1, 2, 3):
        raise ConfigError(f"{role}.zero_stage: {zero_stage}; valid: 1, 2, 3")
    if tp_size < 1:
        raise ConfigError(f"{role}.tensor_parallel_size: {tp_size}; must be ≥ 1")
    if tp_size > 1 and strategy != "fsdp2":
        raise ConfigError(
            f"{role}.tensor_parallel_size: {tp_size} needs {role}.strategy fsdp2, not {strategy}"
        )
    if tp_size > 1 and dist.get_world_size() % tp_size:
        raise ConfigError(
            f"{role}.tensor_parallel_size: {tp_size} does not divide the world size {dist.get_world_size()} "
            "(trainer.nnodes × trainer.n_gpus_per_node)"
        )


def full_weights(engine: Any, prefix: str) -> dict[str, torch.Tensor] | None:
    """The unsharded weights of the model an engine trains, keyed like the wrapped model's own state
    dict (``prefix``, e.g. ``"lm."`` of a ``PackedCausalLM``, removed), on the main rank
    (:mod:`verl_core.runtime.ranks`); an empty dict on the other ranks. None for a one-process engine: the
    module's own state dict is already whole. Every rank of a sharded engine must call it."""
    from verl_core.runtime.ranks import rank0_to_main

    if isinstance(getattr(engine, "strategy", None), SingleStrategy):
        return None
    if hasattr(engine, "full_state_dict"):  # DeepSpeed: gathers the ZeRO partitions itself
        full = engine.full_state_dict()
    else:
        from verl_core.training.distributed import full_model_state

        full = full_model_state(engine.model)
    full = rank0_to_main(full) or {}
    return {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}


def _fsdp2(device: torch.device, mp: MixedPrecision | None, tp_size: int, param_offload: bool) -> Any:
    from verl_core.training.distributed import FSDP2Strategy

    return FSDP2Strategy(device.type, tp_size=tp_size, param_offload=param_offload, mixed_precision=mp)
