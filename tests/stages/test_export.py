"""Export: a checkpoint of the run → merged HF dir that reloads with AutoModelForCausalLM and gives
the training policy's logits; registered in MLflow with lineage tags; copied to --to atomically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows.runs import start_run
from stages.export import export_model
from stages.floor.artifacts import (
    copy_export,
    load_tokenizer,
    materialise_export,
    read_policy,
    resolve_source,
    write_policy,
)
from stages.floor.locations import ckpt_stage, template_pack_uri
from stages.floor.policy import build_policy
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig, validate_config
from verl_core.errors import ArtifactNotFoundError, ConfigError
from verl_core.runtime.run import RunContext

TINY = {
    "data": {"arithmetic_train_size": 64, "arithmetic_val_size": 8},
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
    "trainer": {"experiment_name": "export-test"},
}


def _run(root: Path, run_id: str, lora_rank: int) -> tuple[RunContext, VerlFlowConfig]:
    raw = {**TINY, "store": {"url": str(root)}, "model": {**TINY["model"], "lora_rank": lora_rank}}
    cfg = validate_config(raw)
    ctx = start_run(cfg, run_id)
    template_pack.fn(ctx, cfg.data, cfg.model, preprocess.fn(ctx, cfg.data))
    return ctx, cfg


def _checkpoint(ctx: RunContext, cfg: VerlFlowConfig, iteration: int) -> torch.nn.Module:
    """A 'trained' policy committed as ckpt/iter-XXXX: random init, every weight (LoRA B included,
    which PEFT starts at zero) moved off its init so a wrong merge would show."""
    store = ctx.store()
    tokenizer = load_tokenizer(store, template_pack_uri(store, ctx.run_id))
    lm = build_policy(cfg.model, tokenizer, seed=iteration)
    g = torch.Generator().manual_seed(iteration)
    with torch.no_grad():
        for p in lm.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    stage = store.open_stage(ctx.run_id, ckpt_stage(iteration), params={"iteration": iteration})
    write_policy(stage, "policy", lm, tokenizer, cfg.model)
    stage.commit(summary={"iteration": iteration})
    return lm


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_export_reloads_with_the_training_logits(tmp_path: Path, lora_rank: int) -> None:
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ctx, cfg = _run(tmp_path, f"exp-lora{lora_rank}", lora_rank)
    _checkpoint(ctx, cfg, 1)
    _checkpoint(ctx, cfg, 2)
    store = ctx.store()
    tp = template_pack_uri(store, ctx.run_id)
    uri = export_model.fn(ctx, cfg, tp, None)  # None: the latest checkpoint
    m = store.read_manifest(uri)
    assert m.stage == "export/iter-0002" and m.summary["iteration"] == 2
    assert m.inputs["tokenizer"]["uri"] == tp  # the tokenizer comes from the template_pack it was given
    names = {f.name.removeprefix("model/") for f in m.files}
    assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json"} <= names
    assert not any(n.startswith("adapter") for n in names)  # LoRA merged, not an adapter

    out = materialise_export(store, m, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out))
    # the in-training policy, loaded from its checkpoint exactly as the RL loop does
    trained = read_policy(
        store, store.read_manifest(store.manifest_uri(ctx.run_id, "ckpt/iter-0002")), "policy", cfg.model
    )
    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "12 + 7 - 3 = ?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok(text)["input_ids"]])
    assert ids.shape[1] > 5
    expected, got = _logits(trained, ids), _logits(reloaded, ids)
    if lora_rank == 0:
        assert torch.equal(expected, got)
    else:  # W + (α/r)·BA summed once instead of per forward: float32 rounding only
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    gen = reloaded.generation_config
    assert gen.max_new_tokens == cfg.data.max_response_length
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen.eos_token_id

    # registry: one version with the lineage tags
    client = MlflowClient(tracking_uri=ctx.tracking_uri)
    versions = client.search_model_versions("name = 'verl-flow-export-test'")
    mine = [v for v in versions if v.run_id == ctx.mlflow_run_id]
    assert len(mine) == 1
    tags = mine[0].tags
    assert tags["verl_flow.run_id"] == ctx.run_id and tags["verl_flow.iteration"] == "2"
    assert tags["verl_flow.export_uri"] == uri  # the export, found from the version
    assert tags["verl_flow.config_hash"] == cfg.config_hash()
    assert tags["verl_flow.data_manifest_sha256"] == store.manifest_sha256(
        store.manifest_uri(ctx.run_id, "preprocess")
    )
    # rerun: skipped, no second registry version
    assert export_model.fn(ctx, cfg, tp, 2) == uri and store.read_manifest(uri).attempt == m.attempt
    assert (
        len(
            [
                v
                for v in client.search_model_versions("name = 'verl-flow-export-test'")
                if v.run_id == ctx.mlflow_run_id
            ]
        )
        == 1
    )


def test_source_choice_and_copy(tmp_path: Path) -> None:
    ctx, cfg = _run(tmp_path / "store", "src", 0)
    store = ctx.store()
    with pytest.raises(ArtifactNotFoundError, match="no policy checkpoint at iteration None"):
        resolve_source(store, ctx.run_id, None)
    _checkpoint(ctx, cfg, 3)
    assert resolve_source(store, ctx.run_id, None).stage == "ckpt/iter-0003"
    with pytest.raises(ArtifactNotFoundError, match=r"iteration 5 \(checkpoints: 3"):
        resolve_source(store, ctx.run_id, 5)
    no_registry = cfg.model_copy(update={"export": cfg.export.model_copy(update={"register_model": False})})
    m = store.read_manifest(export_model.fn(ctx, no_registry, template_pack_uri(store, ctx.run_id), 3))
    dest = copy_export(store, m, str(tmp_path / "out" / "model"))
    assert sorted(p.name for p in Path(dest).iterdir()) == sorted(
        f.name.removeprefix("model/") for f in m.files
    )
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no partial dir left
    with pytest.raises(ConfigError, match="exists and is not empty"):
        copy_export(store, m, dest)
