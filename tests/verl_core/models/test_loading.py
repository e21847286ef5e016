"""Model loading: scratch configs, clear errors, save/reload round trip, gradient checkpointing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from verl_core.errors import ConfigError
from verl_core.files import write_files
from verl_core.models.checkpoint import model_files
from verl_core.models.loading import (
    ModelLoadError,
    QuantSpec,
    ScratchSpec,
    apply_lora,
    enable_gradient_checkpointing,
    init_causal_lm,
    load_causal_lm,
    scratch_config,
)

SPEC = ScratchSpec("llama", 32, 2, 4, 2, 64, 64)


def tiny(seed: int = 0) -> torch.nn.Module:
    return init_causal_lm(scratch_config(SPEC, 50, eos_token_id=0, pad_token_id=0), seed=seed)


def test_scratch_init_is_deterministic_and_sized() -> None:
    a, b = tiny(1), tiny(1)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(next(tiny(2).parameters()), next(a.parameters()))
    assert a.config.vocab_size == 50 and a.config.num_hidden_layers == 2 and a.config.use_cache is False


def test_bad_sizes_and_architecture_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="hidden_size: 30 is not divisible by num_attention_heads"):
        scratch_config(ScratchSpec("qwen2", 30, 2, 4, 2, 64, 64), 50, eos_token_id=0, pad_token_id=0)
    with pytest.raises(ConfigError, match="expected one of qwen2, llama"):
        scratch_config(ScratchSpec("gpt9", 32, 2, 4, 2, 64, 64), 50, eos_token_id=0, pad_token_id=0)


def test_save_and_reload_round_trip(tmp_path: Path) -> None:
    model = tiny()
    directory = write_files(model_files(model), tmp_path / "m")
    assert (directory / "model.safetensors").is_file()
    again = load_causal_lm(str(directory))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_models_read_from_files_own_aligned_memory(tmp_path: Path) -> None:
    # from_pretrained leaves views into the safetensors buffer (16-byte aligned here); MKL rounds a GEMM
    # on such a tensor differently from one on a 64-byte-aligned tensor built in memory, which made a
    # resumed run's critic update differ in the last bit (tests/reliability/test_determinism.py)
    from verl_core.models.heads import load_value_model, value_model_from_policy

    model = tiny()  # tied embeddings
    directory = write_files(model_files(model), tmp_path / "m")
    again = load_causal_lm(str(directory))
    critic_dir = write_files(model_files(value_model_from_policy(model, seed=1)), tmp_path / "c")
    for loaded in (again, load_value_model(str(critic_dir))):
        tensors = [*loaded.parameters(), *loaded.buffers()]
        assert tensors and all(t.data_ptr() % 64 == 0 for t in tensors)
    assert again.lm_head.weight is again.model.embed_tokens.weight  # still tied
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_missing_and_corrupt_checkpoints_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model.path: '/nonexistent/model' is not a directory"):
        load_causal_lm("/nonexistent/model")
    directory = write_files(model_files(tiny()), tmp_path / "bad")
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=r"is not a loadable checkpoint|cannot load"):
        load_causal_lm(str(directory))


def test_flash_attention_refused_without_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match=r"flash-attn: not installed .*flash_attention_2.*verl-flow\[gpu\]"):
        init_causal_lm(
            scratch_config(SPEC, 50, eos_token_id=0, pad_token_id=0),
            seed=0,
            attn_implementation="flash_attention_2",
        )


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_qlora_without_bitsandbytes_is_a_clear_error(tmp_path: Path) -> None:
    directory = write_files(model_files(tiny()), tmp_path / "m")
    with pytest.raises(
        ConfigError,
        match=r"^bitsandbytes: not installed \(expected >=0.45, needed by model.quantization\); "
        r"fix: pip install 'verl-flow\[qlora\]'$",
    ):
        load_causal_lm(str(directory), quantization=QuantSpec(4, "nf4", True, "bfloat16"))


def test_gradient_checkpointing_gives_identical_loss_and_grads() -> None:
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    plain, ckpt = tiny(), tiny()
    enable_gradient_checkpointing(ckpt)
    results = []
    for m in (plain, ckpt):
        m.train()
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        results.append((loss, torch.autograd.grad(loss, list(m.parameters()))))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)


def test_lora_freezes_the_base() -> None:
    lora = apply_lora(tiny(), rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
