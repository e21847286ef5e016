"""The SFT warm-up stage: learns, checkpoints, resumes to identical weights, LoRA, skip on rerun."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute
import pytest
import torch

from stages.floor.artifacts import load_tokenizer
from stages.preprocess import preprocess
from stages.sft import CKPT_STAGE, sft_warmup
from stages.template_pack import template_pack
from verl_core.config import DataConfig, ModelConfig, SFTConfig, TrainerConfig
from verl_core.runtime.run import RunContext
from verl_core.training.engine import TrainEngine

DATA = DataConfig(arithmetic_train_size=96, arithmetic_val_size=16)
MODEL = ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
SFT = SFTConfig(epochs=1, batch_size=16, lr=3e-3, warmup_ratio=0.0, val_every=3, save_every=2, log_every=2)


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("sft-data")
    ctx = RunContext(run_id="data", store_url=str(root))
    uri = template_pack.fn(ctx, DATA, MODEL, preprocess.fn(ctx, DATA))
    return root, uri


def _ctx(root: Path, run_id: str) -> RunContext:
    return RunContext(run_id=run_id, store_url=str(root))


def _policy_sha(ctx: RunContext, stage: str = "sft") -> dict[str, str]:
    store = ctx.store()
    m = store.committed(ctx.run_id, stage)
    assert m is not None
    return {f.name: f.sha256 for f in m.files if f.name.startswith("policy/") and "safetensors" in f.name}


def test_sft_learns_and_writes_a_loadable_policy(packed_data: tuple[Path, str]) -> None:
    root, tp = packed_data
    ctx = _ctx(root, "learn")
    uri = sft_warmup.fn(ctx, MODEL, SFT.model_copy(update={"epochs": 3}), TrainerConfig(), tp)
    store = ctx.store()
    m = store.read_manifest(uri)
    assert m.summary["steps"] == 18  # 3 epochs × ceil(96 / 16)
    assert m.summary["final_val_loss"] < m.summary["first_val_loss"]
    assert m.summary["train_seconds"] > 0  # sizes benchmarks/learning.py's SFT-only control
    names = {f.name for f in m.files}
    assert {"policy/config.json", "policy/model.safetensors", "policy/tokenizer.json"} <= names
    metrics = store.read_table(m, "metrics.parquet").to_pylist()
    losses = [r["value"] for r in metrics if r["name"] == "sft/loss"]
    assert len(losses) == 18 and losses[-1] < losses[0]
    from stages.floor.artifacts import read_policy

    lm = read_policy(store, m, "policy", MODEL)
    assert lm.config.vocab_size == len(load_tokenizer(store, tp))
    assert sum(p.numel() for p in lm.parameters()) == m.summary["trainable_params"]
    # rerun with the same inputs: skipped, same manifest
    assert sft_warmup.fn(ctx, MODEL, SFT.model_copy(update={"epochs": 3}), TrainerConfig(), tp) == uri
    assert store.read_manifest(uri).attempt == m.attempt


def test_killed_sft_resumes_to_identical_weights(
    packed_data: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tp = packed_data
    # uninterrupted: 6 steps, checkpoints after steps 2 and 4
    straight = _ctx(root, "straight")
    sft_warmup.fn(straight, MODEL, SFT, TrainerConfig(), tp)

    # interrupted after the checkpoint at step 4 (the 5th step dies)
    crashed = _ctx(root, "crashed")
    real_step = TrainEngine.step
    calls = {"n": 0}

    def dying_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("killed")
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(TrainEngine, "step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        sft_warmup.fn(crashed, MODEL, SFT, TrainerConfig(), tp)
    store = crashed.store()
    assert store.committed("crashed", "sft") is None  # nothing half-written is visible
    ckpt = store.committed("crashed", CKPT_STAGE)
    assert ckpt is not None and ckpt.summary["step"] == 4
    monkeypatch.setattr(TrainEngine, "step", real_step)

    sft_warmup.fn(crashed, MODEL, SFT, TrainerConfig(), tp)
    assert _policy_sha(crashed) == _policy_sha(straight)
    # the metrics history survives the crash too
    m_straight = straight.store().committed("straight", "sft")
    m_crashed = store.committed("crashed", "sft")
    assert m_straight is not None and m_crashed is not None
    rows = [
        straight.store().read_table(m_straight, "metrics.parquet"),
        store.read_table(m_crashed, "metrics.parquet"),
    ]
    drop_perf = [t.filter(pa.compute.invert(pa.compute.starts_with(t.column("name"), "perf/"))) for t in rows]
    assert drop_perf[0].equals(drop_perf[1])


def test_lora_sft_trains_adapters_only(packed_data: tuple[Path, str]) -> None:
    root, tp = packed_data
    ctx = _ctx(root, "lora")
    lora = MODEL.model_copy(update={"lora_rank": 4, "lora_alpha": 8})
    uri = sft_warmup.fn(ctx, lora, SFT.model_copy(update={"save_every": 0}), TrainerConfig(), tp)
    store = ctx.store()
    m = store.read_manifest(uri)
    names = {f.name for f in m.files}
    assert "policy/adapter_model.safetensors" in names and "policy/adapter_config.json" in names
    assert "policy-base/model.safetensors" in names  # a scratch base is saved beside the adapter
    from stages.floor.artifacts import read_policy

    lm = read_policy(store, m, "policy", lora)
    trainable = {n for n, p in lm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # the reference policy of a LoRA actor is the base with adapters disabled: no second copy
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        with lm.disable_adapter():
            base_logits = lm(input_ids=ids).logits
        adapted = lm(input_ids=ids).logits
    assert not torch.allclose(base_logits, adapted)
