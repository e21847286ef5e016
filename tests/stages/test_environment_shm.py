"""``verl-flow doctor --config`` reports /dev/shm against a full weight sync of the config's model
(stages.floor.environment): the bytes come from the model's geometry, built on the meta device."""

from __future__ import annotations

import pytest

from stages.floor.environment import doctor_checks, shm_sync_checks, weight_sync_bytes
from verl_core.config import load_config
from verl_core.rollout import weight_sync

# The schema's scratch model: hidden 128, 2 layers, 4 heads (head_dim 32), 2 kv heads, MLP 256,
# vocab 512, tied embeddings:
#   embed_tokens 512·128 = 65,536 and lm_head.weight (tied, staged as its own copy) 65,536
#   per layer q 128·128 + 128 = 16,512, k and v 64·128 + 64 = 8,256 each, o 16,384,
#   MLP 3 · 128·256 = 98,304, two norms 256: 147,968; two layers 295,936; final norm 128
#   = 427,136 parameters
SCRATCH_PARAMS = 427_136


def test_weight_sync_bytes_from_the_config_geometry() -> None:
    assert weight_sync_bytes(load_config(None, [])) == SCRATCH_PARAMS * 4  # model.dtype float32
    # fp32 masters, bf16 compute: staged in the engine's compute dtype, 2 bytes
    bf16 = load_config(None, ["actor.mixed_precision.param_dtype=bfloat16"])
    assert weight_sync_bytes(bf16) == SCRATCH_PARAMS * 2


def test_doctor_reports_shm_for_vllm_full_weight_syncs_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_sync, "shm_space", lambda: (1 << 20, 64 << 20))  # 1 MiB free of 64 MiB
    cfg = load_config(None, ["rollout.name=vllm", "tracking.enabled=false"])
    [row] = [c for c in doctor_checks(cfg, timeout_s=1) if c.name == "/dev/shm"]
    # 427,136 · 4 B = 1.63 MiB of fp32 weights do not fit in 1 MiB
    assert row.status == "warn" and "--shm-size" in row.fix
    assert row.expected == "≥ 2 MiB to stage 2 MiB of weights (rollout.name: 'vllm')"
    # two ranks on the node, tp 1: two engines sync at once, 2 · 1.63 MiB
    spmd = ["rollout.name=vllm", "trainer.n_gpus_per_node=2", "actor.strategy=fsdp2", "critic.strategy=fsdp2"]
    [row] = shm_sync_checks(load_config(None, spmd))
    assert row.expected == "≥ 3 MiB to stage 3 MiB of weights (rollout.name: 'vllm', 2 engines per node)"
    assert shm_sync_checks(load_config(None, ["rollout.name=hf"])) == []  # hf: nothing is staged
    assert shm_sync_checks(load_config(None, ["rollout.name=vllm", "model.lora_rank=8"])) == []  # adapters
