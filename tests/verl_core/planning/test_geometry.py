"""Parameter counts from the config, checked against models transformers builds."""

from __future__ import annotations

from torch import nn

from verl_core.config.model import ModelConfig
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.planning.geometry import Geometry, from_hf_config, geometry_of


def test_qwen25_05b_counts_are_the_published_ones() -> None:
    # Qwen2.5-0.5B: per layer q 896·896+896, k and v 896·128+128 each, o 896·896, MLP 3·896·4864,
    # norms 2·896 = 14,912,384; embedding 151,936·896 = 136,134,656; 24 layers + embedding + final
    # norm 896 = 494,032,768 parameters (tied head).
    g = Geometry("qwen2", 896, 24, 14, 2, 64, 4864, 151_936)
    assert g.layer_params == 14_912_384
    assert g.embedding_params == 136_134_656
    assert g.n_params == 494_032_768
    # the KV cache: 2 (k, v) · 24 layers · 2 heads · 64 = 6,144 elements per token
    assert g.kv_bytes_per_token == 6_144


def test_scratch_geometry_matches_the_model_transformers_builds() -> None:
    cfg = ModelConfig(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, vocab_size=300,
    )  # fmt: skip
    g = geometry_of(cfg)
    spec = ScratchSpec("qwen2", 64, 3, 4, 2, 96, 128)
    model = init_causal_lm(scratch_config(spec, 300, eos_token_id=0, pad_token_id=0), seed=0)
    assert g.n_params == sum(p.numel() for p in model.parameters())  # tied: counted once by torch
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert g.matmul_params == linear  # the tied LM head is one nn.Linear over the embedding
    assert from_hf_config(model.config) == g


def test_llama_has_no_qkv_bias_and_lora_counts_every_projection() -> None:
    cfg = ModelConfig(
        architecture="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, vocab_size=280,
    )  # fmt: skip
    g = geometry_of(cfg)
    spec = ScratchSpec("llama", 32, 2, 4, 2, 48, 128)
    model = init_causal_lm(scratch_config(spec, 280, eos_token_id=0, pad_token_id=0), seed=0)
    assert g.n_params == sum(p.numel() for p in model.parameters())
    # rank 2 on q (32→32), k, v (32→16), o (32→32), gate, up (32→48), down (48→32):
    # 2·(64 + 48 + 48 + 64 + 80 + 80 + 80) = 928 per layer, 1,856 for 2 layers
    assert g.lora_params(2) == 1_856
