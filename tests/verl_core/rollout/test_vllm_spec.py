"""The vLLM spec and its one memory rule, without vLLM: the kwargs the rule gives pass vLLM's start-up
check (``Worker.init_device`` → ``request_memory``, rewritten below from vLLM's source), the LoRA rank
is one vLLM accepts, the spec crosses the subprocess channel as JSON."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from verl_core.errors import ConfigError
from verl_core.rollout.vllm_spec import (
    GIB,
    WORKER_CONTEXT_BYTES,
    PlatformFacts,
    VLLMSpec,
    llm_kwargs,
    max_lora_rank,
    memory_kwargs,
)

VLLM_DEFAULT_UTILIZATION = 0.92  # vLLM 0.33's CacheConfig.gpu_memory_utilization, when none is passed


def spec(**changes: object) -> VLLMSpec:
    base = VLLMSpec(
        dtype="bfloat16", trust_remote_code=False, tensor_parallel_size=1, gpu_memory_utilization=0.5,
        kv_cache_gib=None, cpu_kv_cache_gib=1.0, enforce_eager=False, max_model_len=None,
        weight_sync_bucket_mb=512,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def gpu(free_gib: float | None, total_gib: float = 80.0) -> PlatformFacts:
    memory = None if free_gib is None else (int(free_gib * GIB), int(total_gib * GIB))
    return PlatformFacts(is_cpu=False, sleep_mode=True, generator_offset=True, device_memory=memory)


CPU = PlatformFacts(is_cpu=True, sleep_mode=False, generator_offset=False, device_memory=None)


def vllm_start_check_passes(kwargs: dict[str, object], free: int, total: int) -> bool:
    """vLLM's check at worker start: ceil(total × utilization) ≤ the free memory it then sees (ours
    less the worker's own context, :data:`WORKER_CONTEXT_BYTES` at most), whatever the KV bytes."""
    utilization = float(kwargs.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))  # type: ignore[arg-type]
    return math.ceil(total * utilization) <= free - WORKER_CONTEXT_BYTES


def test_kv_cache_gib_on_a_gpu_passes_a_utilization_the_free_memory_satisfies() -> None:
    # the trainer holds 50 of 80 GiB: 30 GiB free. The old rule passed kv_cache_memory_bytes alone,
    # so vLLM checked its 0.92 × 80 = 73.6 GiB against 30 GiB and refused to start.
    facts = gpu(free_gib=30)
    kwargs = memory_kwargs(spec(kv_cache_gib=4.0), facts)
    assert kwargs["kv_cache_memory_bytes"] == 4 * GIB
    # (30 - 1) / 80 = 0.3625 → 0.36, below the configured 0.5
    assert kwargs["gpu_memory_utilization"] == 0.36
    assert vllm_start_check_passes(kwargs, *facts.device_memory)  # type: ignore[misc]
    # plenty free (70 of 80 GiB): the configured utilization, 0.5
    roomy = memory_kwargs(spec(kv_cache_gib=4.0), gpu(free_gib=70))
    assert roomy["gpu_memory_utilization"] == 0.5
    # free memory not measured (no NVML): the configured utilization
    assert memory_kwargs(spec(kv_cache_gib=4.0), gpu(None))["gpu_memory_utilization"] == 0.5
    # for every free amount a utilization exists at all: the check passes
    for free_gib in (2, 5.5, 13, 39.9, 79):
        facts = gpu(free_gib)
        assert vllm_start_check_passes(memory_kwargs(spec(kv_cache_gib=1.0), facts), *facts.device_memory)  # type: ignore[misc]


def test_no_room_for_vllm_is_refused_naming_the_field() -> None:
    # 0.5 GiB free: less than the worker's own 1 GiB, no utilization can pass
    with pytest.raises(ConfigError, match=r"^rollout.kv_cache_gib: vLLM needs free device memory"):
        memory_kwargs(spec(kv_cache_gib=1.0), gpu(free_gib=0.5))
    # without kv_cache_gib: 0.5 × 80 = 40 GiB asked, 30 GiB free
    with pytest.raises(ConfigError, match=r"^rollout.gpu_memory_utilization: 0.5 of the device is 40.0 GiB"):
        memory_kwargs(spec(), gpu(free_gib=30))
    assert memory_kwargs(spec(), gpu(free_gib=60)) == {"gpu_memory_utilization": 0.5}


def test_the_cpu_platform_sizes_the_kv_cache_in_bytes() -> None:
    # a utilization would be a share of the machine's RAM there
    assert memory_kwargs(spec(), CPU) == {"kv_cache_memory_bytes": GIB}
    assert memory_kwargs(spec(kv_cache_gib=0.25), CPU) == {"kv_cache_memory_bytes": GIB // 4}


@pytest.mark.parametrize(
    ("rank", "allowed"),
    [(1, 1), (4, 8), (8, 8), (9, 16), (64, 64), (96, 128), (100, 128), (320, 320), (321, 512), (512, 512)],
)
def test_the_smallest_lora_rank_vllm_accepts(rank: int, allowed: int) -> None:
    # vLLM's allowed max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320, 512 (the old max(64, r) gave
    # 64 for r=8, and 96 / 100, which vLLM rejects)
    assert max_lora_rank(rank) == allowed


def test_a_lora_rank_above_512_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^model.lora_rank: 513 is above the largest LoRA rank vLLM"):
        max_lora_rank(513)


def test_llm_kwargs_of_a_lora_policy_on_cpu_and_on_a_gpu() -> None:
    on_cpu = llm_kwargs(spec(max_model_len=256), CPU, lora_rank=96)
    assert on_cpu == {
        "tensor_parallel_size": 1,
        "dtype": "bfloat16",
        "trust_remote_code": False,
        "enforce_eager": False,
        "enable_sleep_mode": False,  # the CPU platform has none
        "enable_lora": True,
        "max_lora_rank": 128,
        "logprobs_mode": "processed_logprobs",
        "kv_cache_memory_bytes": GIB,
        "enable_chunked_prefill": False,  # the CPU generator has no offset
        "max_model_len": 256,
    }
    on_gpu = llm_kwargs(spec(), gpu(free_gib=70), lora_rank=None)
    assert on_gpu["enable_sleep_mode"] and not on_gpu["enable_lora"]
    assert "max_lora_rank" not in on_gpu and "enable_chunked_prefill" not in on_gpu
    assert "distributed_executor_backend" not in on_gpu  # one engine per process: vLLM's own executor


def test_the_spec_crosses_the_channel_as_json_and_has_no_defaults() -> None:
    s = spec(kv_cache_gib=2.5, max_model_len=128)
    assert VLLMSpec.from_json(json.loads(json.dumps(s.to_json()))) == s
    with pytest.raises(ValueError, match=r"fields \['extra'\] missing or unknown"):
        VLLMSpec.from_json({**s.to_json(), "extra": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.dtype = "float32"  # type: ignore[misc]
    # every field must be given: the schema's rollout section holds the defaults
    assert all(f.default is dataclasses.MISSING for f in dataclasses.fields(VLLMSpec))
