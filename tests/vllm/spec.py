"""The vLLM engine spec of the tests in the vLLM environment: fp32 like the tiny models (and the HF
engine they are compared with), eager (a faster start), a 0.25 GiB KV cache on the CPU platform."""

from __future__ import annotations

import dataclasses
from typing import Any

from verl_core.rollout.vllm_spec import VLLMSpec


def engine_spec(**changes: Any) -> VLLMSpec:
    spec = VLLMSpec(
        dtype="float32", trust_remote_code=False, tensor_parallel_size=1, gpu_memory_utilization=0.5,
        kv_cache_gib=None, cpu_kv_cache_gib=0.25, enforce_eager=True, max_model_len=256,
        weight_sync_bucket_mb=512,
    )  # fmt: skip
    return dataclasses.replace(spec, **changes)
