"""``write_policy`` streams a policy's files to the store from ``save_pretrained``'s folder: the store
holds exactly the bytes ``model_files`` makes (the former bytes path), full and scratch-LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.floor.artifacts import _plain_base, files_under, write_policy
from verl_core.config import ModelConfig
from verl_core.models.checkpoint import model_files
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.store import ArtifactStore


def _tiny() -> object:
    config = scratch_config(ScratchSpec("qwen2", 16, 1, 2, 1, 32, 64), 50, eos_token_id=0, pad_token_id=0)
    return init_causal_lm(config, seed=0)


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_written_policy_files_are_the_bytes_model_files_makes(tmp_path: Path, lora_rank: int) -> None:
    lm = _tiny()
    model = ModelConfig(init="scratch", lora_rank=lora_rank)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        lm = get_peft_model(lm, LoraConfig(r=lora_rank, target_modules=["q_proj", "v_proj"]))
    store = ArtifactStore(str(tmp_path / "store"))
    stage = store.open_stage("run", "ckpt")
    write_policy(stage, "policy", lm, None, model)
    manifest = store.read_manifest(stage.commit(summary={}))
    written = files_under(store, manifest, "policy")
    assert written == model_files(lm, None) and any(n.endswith(".safetensors") for n in written)
    if lora_rank:  # the frozen base, rebuilt as a plain model, byte for byte too
        assert files_under(store, manifest, "policy-base") == model_files(_plain_base(lm), None)
