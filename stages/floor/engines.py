"""The rollout engine of a run from its config: each engine's keyword arguments (the ``rollout``
section, in the policy's compute dtype), ``rollout.name=auto`` resolved for a device, and this rank's
engine under torchrun (:mod:`verl_core.rollout.placement`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from verl_core.config import VerlFlowConfig
from verl_core.errors import ConfigError
from verl_core.rollout import ENGINES, RolloutEngine, make_engine
from verl_core.rollout.placement import GroupMemberEngine, current_topology, engine_placement
from verl_core.rollout.registry import EngineFactory
from verl_core.rollout.vllm_spec import VLLMSpec
from verl_core.runtime.ranks import all_gather, rank, world_size


def compute_dtype(cfg: VerlFlowConfig) -> str:
    """The dtype the policy computes in, which its rollouts use too: ``actor.mixed_precision.param_dtype``
    when set (fp32 master weights, bf16 compute), else ``model.dtype``."""
    return cfg.actor.mixed_precision.param_dtype or cfg.model.dtype


def _hf_engine_kwargs(cfg: VerlFlowConfig) -> dict[str, Any]:
    rollout = cfg.rollout
    return {
        "max_batch_size": rollout.max_batch_size,
        "share_weights": rollout.share_weights,
        "decode": rollout.decode,
        "compute_dtype": compute_dtype(cfg),
    }


def vllm_spec(cfg: VerlFlowConfig) -> VLLMSpec:
    """The vLLM engine's settings: the ``rollout`` section's, in the policy's compute dtype."""
    rollout = cfg.rollout
    return VLLMSpec(
        dtype=compute_dtype(cfg),  # never vLLM's "auto", which would halve a float32 model
        trust_remote_code=cfg.model.trust_remote_code,
        tensor_parallel_size=rollout.tensor_parallel_size,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        kv_cache_gib=rollout.kv_cache_gib,
        cpu_kv_cache_gib=rollout.cpu_kv_cache_gib,
        enforce_eager=rollout.vllm_enforce_eager,
        max_model_len=None,  # the model's own context length
        weight_sync_bucket_mb=rollout.weight_sync_bucket_mb,
    )


def _vllm_engine_kwargs(cfg: VerlFlowConfig) -> dict[str, Any]:
    return {"spec": vllm_spec(cfg), "vllm_python": cfg.rollout.vllm_python}


def _auto_engine_kwargs(cfg: VerlFlowConfig) -> dict[str, Any]:
    """Both engines' arguments: ``auto`` picks one when it is built (it knows the device then)."""
    return {"hf": _hf_engine_kwargs(cfg), "vllm": _vllm_engine_kwargs(cfg)}


EngineKwargs = Callable[[VerlFlowConfig], dict[str, Any]]

# Each rollout engine's keyword arguments, keyed by its entry in verl_core's registry (the factory
# itself), not by a second copy of its names: a name resolves once, through ENGINES
ENGINE_KWARGS: dict[EngineFactory, EngineKwargs] = {
    ENGINES.get("hf"): _hf_engine_kwargs,
    ENGINES.get("vllm"): _vllm_engine_kwargs,
    ENGINES.get("auto"): _auto_engine_kwargs,
}


def engine_kwargs(cfg: VerlFlowConfig, name: str | None = None) -> dict[str, Any]:
    """Keyword arguments of ``verl_core.rollout.make_engine(name, ...)``, ``name`` by default
    ``rollout.name`` (an unknown one fails with the engine registry's list of names; an engine
    registered by a user's code, which the floor has no arguments for, fails naming it)."""
    name = cfg.rollout.name if name is None else name
    kwargs = ENGINE_KWARGS.get(ENGINES.get(name))
    if kwargs is None:
        known = ", ".join(sorted(n for n in ENGINES.names() if ENGINES.get(n) in ENGINE_KWARGS))
        raise ConfigError(
            f"rollout.name={name!r}: the pipeline knows no engine arguments for it (it builds {known}); "
            "a registered engine replaced or added after import is not built by the stages"
        )
    return kwargs(cfg)


def build_rollout_engine(
    cfg: VerlFlowConfig, lm: nn.Module, tokenizer: Any, device: torch.device
) -> RolloutEngine:
    """This rank's rollout engine for the policy ``lm`` (moved to ``device``). One process: the
    ``rollout.name`` engine. Under torchrun (:mod:`verl_core.rollout.placement`): ``auto`` is resolved
    for ``device`` first (every rank alike); an engine spans ``rollout.tensor_parallel_size`` ranks
    (vLLM; the HF engine one), its group's first rank starts it pinned to the group's devices or cores,
    and the group's other ranks hold a :class:`GroupMemberEngine`
    (:func:`~stages.floor.rollouts.sharded_rollouts` hands them the group's rollouts)."""
    lm, rollout = lm.to(device), cfg.rollout
    if world_size() == 1:
        return make_engine(rollout.name, lm, tokenizer, **engine_kwargs(cfg))
    name = resolved_engine_name(rollout.name, device.type, rollout.vllm_python)
    tensor_parallel_size = rollout.tensor_parallel_size if name == "vllm" else 1
    placement = engine_placement(current_topology(), tensor_parallel_size, device.type)
    engine: RolloutEngine = GroupMemberEngine(tensor_parallel_size)
    failed: BaseException | None = None
    if placement.owner:
        kwargs = engine_kwargs(cfg, name)
        if name == "vllm":
            kwargs["env"] = dict(placement.env)
        try:
            engine = make_engine(name, lm, tokenizer, **kwargs)
        except Exception as e:  # raised below, once every rank knows
            failed = e
    # every rank waits here for every engine: a group's other ranks load nothing onto the devices an
    # engine is measuring and profiling, and one engine failing to start fails every rank now instead
    # of leaving the others in the next collective until its timeout
    failures = [f for f in all_gather([None if failed is None else f"rank {rank()}: {failed}"]) if f]
    if failed is not None:
        raise failed
    if failures:
        engine.close()
        raise RuntimeError(f"rollout engine start failed on {len(failures)} rank(s): {'; '.join(failures)}")
    return engine


def resolved_engine_name(name: str, device_type: str, vllm_python: str) -> str:
    """``rollout.name`` with ``auto`` decided for ``device_type`` as ``make_engine("auto", ...)`` decides
    it (:data:`verl_core.rollout.registry.AUTO_ENGINE`, hf where vLLM is not available)."""
    from verl_core.rollout.registry import AUTO_ENGINE, _vllm_ready

    if name != "auto":
        return name
    chosen = AUTO_ENGINE.get(device_type, "hf")
    return chosen if chosen != "vllm" or _vllm_ready(vllm_python) else "hf"
