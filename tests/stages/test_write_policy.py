"""``write_policy`` streams a policy's files to the store from ``save_pretrained``'s folder: the store
holds exactly the bytes ``model_files`` makes (the former bytes path), full and scratch-LoRA.
``read_policy`` loads them back through ``local_model_dir``: links to a local store's own files (a
download elsewhere), each checked against the manifest, never read whole into memory; training the
loaded policy leaves the store's files as committed."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from stages.floor.artifacts import _plain_base, files_under, local_model_dir, read_policy, write_policy
from verl_core.config import ModelConfig
from verl_core.errors import ArtifactCorruptError, ConfigError
from verl_core.models.checkpoint import model_files
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.store import ArtifactStore, Manifest


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


def _committed(store: ArtifactStore, lm: Any, model: ModelConfig) -> Manifest:
    stage = store.open_stage("run", "ckpt")
    write_policy(stage, "policy", lm, None, model)
    return store.read_manifest(stage.commit(summary={}))


def test_read_policy_is_the_written_one_and_training_it_leaves_the_store_as_committed(tmp_path: Path) -> None:
    lm: Any = _tiny()
    model = ModelConfig(init="scratch")
    store = ArtifactStore(str(tmp_path / "store"))
    manifest = _committed(store, lm, model)
    read = read_policy(store, manifest, "policy", model)
    theirs = read.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in lm.state_dict().items())
    with torch.no_grad():  # an optimizer step writes the parameters in place
        for p in read.parameters():
            p.add_(1.0)
    assert files_under(store, manifest, "policy") == model_files(lm, None)


def test_local_model_dir_links_a_local_stores_own_files_checked(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    manifest = _committed(store, _tiny(), ModelConfig(init="scratch"))
    written = files_under(store, manifest, "policy")
    with local_model_dir(store, manifest, "policy") as directory:
        files = {p.name: p for p in directory.iterdir()}
        assert set(files) == set(written)
        # no copy: each name links to the store's file of the manifest entry
        assert all(p.is_symlink() and p.resolve().is_relative_to(tmp_path / "store") for p in files.values())
        assert {n: p.read_bytes() for n, p in files.items()} == written
    assert not directory.exists()
    with (
        pytest.raises(ConfigError, match="no checkpoint under critic/"),
        local_model_dir(store, manifest, "critic"),
    ):
        pass
    stored = next(p for p in (tmp_path / "store").rglob("*.safetensors"))
    stored.write_bytes(stored.read_bytes()[:-1] + b"x")  # changed after commit
    with (
        pytest.raises(ArtifactCorruptError, match=r"model\.safetensors"),
        local_model_dir(store, manifest, "policy"),
    ):
        pass


def test_local_model_dir_downloads_from_an_object_store() -> None:
    store = ArtifactStore(f"memory://policy-{uuid.uuid4().hex[:8]}")
    manifest = _committed(store, _tiny(), ModelConfig(init="scratch"))
    with local_model_dir(store, manifest, "policy") as directory:
        got = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert got == files_under(store, manifest, "policy")
    assert not directory.exists()
