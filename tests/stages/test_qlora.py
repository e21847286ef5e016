"""QLoRA on CPU: a 4-bit NF4 base (bitsandbytes) with LoRA adapters goes through SFT steps and two
GRPO iterations of the real stages, trains only the adapters, and exports a merged HF model.

bitsandbytes' AVX512-BF16 trap (bitsandbytes 0.50): on such CPUs a no-grad eval forward (generation,
validation) repacks the 4-bit weights into a path without autograd, after which LoRA gets no
gradients; ``load_causal_lm`` turns that path off. Here every update follows a generation, and the
actor has no weight decay, so an adapter that moves got a gradient.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from flows.loop import Loop
from flows.rl import loop_stages, run_iteration
from stages.export import export_model
from stages.floor.artifacts import load_tokenizer, materialise_export, read_policy
from stages.floor.checkpoint import save_checkpoint
from stages.floor.locations import ckpt_stage, iteration_stage
from stages.floor.opening import open_session
from stages.floor.policy import build_policy
from stages.floor.session import bound
from stages.preprocess import preprocess
from stages.sft import sft_warmup
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig, validate_config
from verl_core.models.loading import QuantSpec, apply_lora, load_causal_lm
from verl_core.runtime.run import RunContext

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes not installed (pip install 'verl-flow[qlora]')",
)

SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
DATA = {
    "arithmetic_train_size": 32,
    "arithmetic_val_size": 4,
    "train_batch_size": 2,
    "max_response_length": 8,
    "truncation": "right",
}


SFT = {"epochs": 1, "max_steps": 3, "batch_size": 8, "lr": 1e-2, "save_every": 0, "val_every": 2}


def _config(root: Path, model: dict[str, Any]) -> VerlFlowConfig:
    return validate_config(
        {
            "store": {"url": str(root)},
            "data": DATA,
            "model": model,
            "sft": SFT,
            # GRPO with a KL loss to the base (adapters disabled): the KL term alone already gives the
            # adapters a gradient after SFT moved them, whatever the (tiny model's) rewards
            "algorithm": {"adv_estimator": "grpo"},
            "actor": {"lr": 1e-2, "weight_decay": 0.0, "ppo_mini_batch_size": 2, "use_kl_loss": True},
            "rollout": {"n": 2},
            "trainer": {"total_iterations": 2, "save_freq": 1, "test_freq": 0, "device": "cpu"},
            "execution": {"task_retries": 0},
            "tracking": {"enabled": False},
        }
    )


def _pretrained_base(root: Path) -> Path:
    """The scratch model with the run's trained tokenizer, saved as an HF dir: the builders quantize
    pretrained bases only (``model.quantization`` is refused for ``init=scratch``)."""
    cfg = _config(root / "store", SIZES)
    ctx = RunContext(run_id="base", store_url=cfg.store.url)
    tp = template_pack.fn(ctx, cfg.data, cfg.model, preprocess.fn(ctx, cfg.data))
    tokenizer = load_tokenizer(ctx.store(), tp)
    lm = build_policy(cfg.model, tokenizer, seed=0)
    out = root / "base"
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _lora(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _linear4bit(model: torch.nn.Module) -> list[Any]:
    import bitsandbytes as bnb

    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def test_generate_then_train_still_reaches_the_adapters(tmp_path: Path) -> None:
    base = _pretrained_base(tmp_path)
    lm = load_causal_lm(str(base), quantization=QuantSpec(4, "nf4", True, "bfloat16"))
    assert _linear4bit(lm) and all(not m.support_avx512bf16_for_cpu for m in _linear4bit(lm))
    lm = apply_lora(lm, rank=4, alpha=8, dropout=0.0, target_modules="all-linear", quantized=True)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    for cycle in range(2):  # generate (no-grad, eval) → train, twice
        lm.eval()
        with torch.no_grad():
            lm.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        lm.train()
        lm.zero_grad()
        lm(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad for n, p in lm.named_parameters() if p.requires_grad}
        # every adapter matrix of every projection (those without bias too: o_proj, the MLP) has a
        # gradient; lora_B starts at zero, so lora_A's gradient is zero in the first cycle
        assert grads and all("lora_" in n for n in grads)
        b_grads = {n: g for n, g in grads.items() if "lora_B" in n}
        assert len(b_grads) == 7 * 2  # q k v o gate up down, 2 layers
        assert all(g is not None and g.abs().sum() > 0 for g in b_grads.values()), cycle
        with torch.no_grad():
            for n, p in lm.named_parameters():
                if "lora_B" in n:
                    p.add_(0.01)  # move B off zero, as a step would


@pytest.fixture(scope="module")
def qlora_sft(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunContext, VerlFlowConfig, str, str]:
    """A QLoRA run through template_pack and SFT: ``(ctx, cfg, template_pack URI, SFT URI)``."""
    root = tmp_path_factory.mktemp("qlora")
    base = _pretrained_base(root)
    qlora = {
        **SIZES,
        "init": "pretrained",
        "path": str(base),
        "lora_rank": 4,
        "lora_alpha": 8,
        "quantization": {"bits": 4, "quant_type": "nf4"},
    }
    cfg = _config(root / "store", qlora)
    ctx = RunContext(run_id="qlora", store_url=cfg.store.url)
    tp = template_pack.fn(ctx, cfg.data, cfg.model, preprocess.fn(ctx, cfg.data))
    return ctx, cfg, tp, sft_warmup.fn(ctx, cfg.model, cfg.sft, cfg.trainer, tp)


def test_a_qlora_policy_reads_back_with_its_4bit_base(
    qlora_sft: tuple[RunContext, VerlFlowConfig, str, str],
) -> None:
    ctx, cfg, _, sft_uri = qlora_sft
    lm = read_policy(ctx.store(), ctx.store().read_manifest(sft_uri), "policy", cfg.model)
    assert _linear4bit(lm)


def test_qlora_sft_and_two_grpo_iterations_train_the_adapters(
    qlora_sft: tuple[RunContext, VerlFlowConfig, str, str], tmp_path: Path
) -> None:
    ctx, cfg, tp, sft_uri = qlora_sft
    store = ctx.store()

    # 1. SFT (on the 4-bit base build_policy makes): finite losses, an adapter saved, not the base
    sft = store.read_manifest(sft_uri)
    assert sft.summary["steps"] == 3 and math.isfinite(sft.summary["final_val_loss"])
    metrics = store.read_table(sft, "metrics.parquet").to_pydict()
    assert "sft/val_loss" in metrics["name"] and all(map(math.isfinite, metrics["value"]))
    names = {f.name for f in sft.files}
    assert "policy/adapter_model.safetensors" in names and not any("policy-base" in n for n in names)

    # 2. Two GRPO iterations from the SFT adapter
    state = open_session(ctx, cfg, tp, sft_uri)
    try:
        trainable = {n for n, p in state.lm.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)  # adapters only
        base_weights = {n: p.detach().clone() for n, p in state.lm.named_parameters() if "lora_" not in n}
        before = _lora(state.lm)
        assert any(v.abs().sum() > 0 for n, v in before.items() if "lora_B" in n)  # SFT moved them
        loop = Loop(ctx, cfg, tp, state.lineage, state.iterations, {}, loop_stages(cfg, as_tasks=False))
        for it in range(2):
            with bound(state):  # as the RL loop binds it for its task shells
                run_iteration(loop, state, it)  # rollout → reward → update
            save_checkpoint(state, ctx, cfg, it + 1)
            update = store.read_manifest(store.manifest_uri(ctx.run_id, iteration_stage(it, "update")))
            assert math.isfinite(update.summary["actor/pg_loss"])
            assert update.summary["policy_version"] == it + 1
            after = _lora(state.lm)
            # no weight decay: a matrix that moved got a gradient, after this iteration's generation
            assert all(not torch.equal(before[n], after[n]) for n in before), it
            before = after
        frozen = [(n, p) for n, p in state.lm.named_parameters() if "lora_" not in n]
        assert all(torch.equal(base_weights[n], p) for n, p in frozen)
        trained = _lora(state.lm)
    finally:
        state.close()

    # 3. The checkpoint reloads the trained adapters; the export merges them into a plain HF model
    ckpt_manifest = store.read_manifest(store.manifest_uri(ctx.run_id, ckpt_stage(2)))
    ckpt = read_policy(store, ckpt_manifest, "policy", cfg.model)
    assert all(torch.equal(trained[n], v) for n, v in _lora(ckpt).items())
    m = store.read_manifest(export_model.fn(ctx, cfg, tp, None))
    assert not any("adapter" in f.name for f in m.files)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(materialise_export(store, m, tmp_path / "hf")))
    assert not _linear4bit(merged) and not any("lora_" in n for n, _ in merged.named_parameters())
    # the export merges into the base in model.dtype (not 4-bit): compare with the adapters on that base
    full = read_policy(store, ckpt_manifest, "policy", cfg.model, for_training=False)
    assert not _linear4bit(full)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        expected = full.eval()(input_ids=ids).logits.float()
        got = merged.eval()(input_ids=ids).logits.float()
        with full.disable_adapter():
            base_logits = full(input_ids=ids).logits.float()
    err, lora_effect = (got - expected).abs().max().item(), (expected - base_logits).abs().max().item()
    print(f"export vs training logits max|d| {err:.2e}, LoRA's effect on the logits {lora_effect:.2e}")
    assert err < 0.1 * lora_effect  # the merge carries the adapters
