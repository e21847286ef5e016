"""bf16 mixed precision (verl_core.training.precision): fp32 master weights and optimizer state, bf16
compute, on one process (autocast), FSDP2 (MixedPrecisionPolicy, 2 gloo ranks) and DeepSpeed's config;
liger-kernel's patch refused on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.verl_core.training import fsdp_worker
from tests.verl_core.training.fsdp_worker import OPTIM, make_model, run_steps
from verl_core.errors import ConfigError
from verl_core.models.loading import apply_liger, unwrap
from verl_core.training.deepspeed_engine import deepspeed_config
from verl_core.training.distributed import decoder_layers
from verl_core.training.precision import MixedPrecision, autocast_forward, cast_buffers
from verl_core.training.strategies import build_train_engine, prepare_frozen

REPO = Path(__file__).resolve().parents[3]
BF16 = MixedPrecision()  # param bf16, reduce fp32, buffers fp32: verl's defaults


def _mlp_dtypes(model: nn.Module) -> list[torch.dtype]:
    """Records the dtype of the first decoder layer's MLP output at every forward."""
    seen: list[torch.dtype] = []
    decoder_layers(model)[0].mlp.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    return seen


def test_single_process_step_keeps_fp32_masters_and_computes_in_bf16() -> None:
    model = make_model()
    seen = _mlp_dtypes(model)
    engine = build_train_engine(model, OPTIM, strategy="single", device="cpu", mixed_precision=BF16)
    grads: set[torch.dtype] = set()  # at each optimizer step (the engine frees them after it)
    engine.optimizer.register_step_pre_hook(
        lambda *_: grads.update(p.grad.dtype for p in model.parameters() if p.grad is not None)
    )
    losses = run_steps(engine, None, 2)
    assert set(seen) == {torch.bfloat16}  # the decoder's matmuls ran in bf16 ...
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # ... from fp32 master weights
    assert grads == {torch.float32}
    state = engine.optimizer.state.values()
    assert {s["exp_avg"].dtype for s in state} == {s["exp_avg_sq"].dtype for s in state} == {torch.float32}
    # the fp32 run from the same init; bf16 keeps ~3 significant digits, the loss (~4.2) moves ~1e-2
    reference = run_steps(build_train_engine(make_model(), OPTIM, strategy="single", device="cpu"), None, 2)
    assert losses == pytest.approx(reference, rel=2e-2)
    assert losses != reference  # it did compute in another precision


def test_log_probs_stay_fp32_under_bf16_compute() -> None:
    model = make_model()
    autocast_forward(model, "cpu", torch.bfloat16)
    ids, cu = torch.tensor([3, 5, 7, 9, 11]), torch.tensor([0, 5], dtype=torch.int32)
    with torch.no_grad():
        out, _ = model(ids, cu)
    # the chunked log-prob upcasts each chunk's logits before the log-sum-exp
    assert out.log_probs.dtype == torch.float32 and out.entropy is not None
    assert out.entropy.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")  # autocast left with the forward


def test_autocast_is_left_when_the_forward_raises() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert torch.is_autocast_enabled("cpu")
            raise RuntimeError("boom")

    boom = Boom()
    handles = autocast_forward(boom, "cpu", torch.bfloat16)
    with pytest.raises(RuntimeError, match="boom"):
        boom(torch.ones(1))
    assert not torch.is_autocast_enabled("cpu")
    for h in handles:
        h.remove()


def test_bf16_parameters_are_not_autocast_again() -> None:
    model = make_model().to(torch.bfloat16)  # model.dtype bfloat16: pure bf16, nothing to mix
    build_train_engine(model, OPTIM, strategy="single", device="cpu", mixed_precision=BF16)
    assert not model._forward_pre_hooks


def test_cast_buffers_casts_floating_buffers_only() -> None:
    m = nn.Module()
    m.register_buffer("freq", torch.ones(2, dtype=torch.float32))
    m.register_buffer("index", torch.arange(2))
    cast_buffers(m, torch.bfloat16)
    assert m.freq.dtype == torch.bfloat16 and m.index.dtype == torch.int64


def test_frozen_reference_computes_in_bf16() -> None:
    ref = make_model()
    seen = _mlp_dtypes(ref)
    ref = prepare_frozen(ref, "single", "cpu", mixed_precision=BF16)
    with torch.no_grad():
        ref(torch.tensor([3, 5, 7]), torch.tensor([0, 3], dtype=torch.int32))
    assert seen == [torch.bfloat16] and {p.dtype for p in ref.parameters()} == {torch.float32}


def test_deepspeed_config_bf16_block() -> None:
    off = deepspeed_config(1.0, 2, None)
    assert off["bf16"] == {"enabled": False} and "communication_data_type" not in off
    on = deepspeed_config(1.0, 3, MixedPrecision(reduce_dtype=torch.bfloat16))
    assert on["bf16"] == {"enabled": True} and on["communication_data_type"] == "bf16"
    assert on["zero_optimization"] == {"stage": 3}


@pytest.mark.slow
def test_fsdp2_mixed_precision_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "mp.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    worker = Path(fsdp_worker.__file__).with_name("mixprec_worker.py")
    proc = subprocess.run(
        [*cmd, str(worker), str(out)], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # sharded master weights and Adam moments fp32; each layer all-gathered and computed in bf16
    assert result["params"] == result["moments"] == ["torch.float32"]
    assert result["mlp_out"] == ["torch.bfloat16"]
    reference = run_steps(build_train_engine(make_model(), OPTIM, strategy="single", device="cpu"), None, 2)
    assert result["losses"] == pytest.approx(reference, rel=2e-2)


def test_liger_is_refused_without_its_package_or_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour; the CUDA path is test_liger_matches_unpatched_log_probs")
    with pytest.raises(ConfigError, match=r"model\.use_liger"):
        apply_liger(unwrap(make_model().lm))


@pytest.mark.gpu
def test_liger_matches_unpatched_log_probs() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (liger-kernel is Triton)")
    pytest.importorskip("liger_kernel", reason="pip install 'verl-flow[liger]'")
    ids, cu = torch.tensor([3, 5, 7, 9, 11, 2, 4], device="cuda"), torch.tensor([0, 4, 7], device="cuda")
    plain, patched = make_model().cuda(), make_model().cuda()  # same seed, same weights
    apply_liger(patched.lm)
    with torch.no_grad():
        a, _ = plain(ids, cu.to(torch.int32))
        b, _ = patched(ids, cu.to(torch.int32))
    torch.testing.assert_close(b.log_probs, a.log_probs, rtol=1e-4, atol=1e-4)


def test_config_names_map_to_dtypes() -> None:
    assert MixedPrecision.from_names(None, "float32", "float32") is None  # param_dtype unset: off
    assert MixedPrecision.from_names("bfloat16", "float32", "float32") == BF16
    assert MixedPrecision.from_names("bfloat16", "bfloat16", "float32").reduce_dtype == torch.bfloat16


def _fraction_changed(dtype: torch.dtype, lr: float, steps: int = 10) -> float:
    """Share of 10,000 weights ~ N(0, 0.02²) stored in ``dtype`` that AdamW at ``lr`` changes in ``steps``
    steps of random (seeded) gradients."""
    g = torch.Generator().manual_seed(0)
    w = nn.Parameter((torch.randn(10_000, generator=g) * 0.02).to(dtype))
    start = w.detach().clone()
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.01)
    for _ in range(steps):
        w.grad = torch.randn(10_000, generator=g).to(dtype)
        opt.step()
    return float((w.detach() != start).float().mean())


def test_pure_bf16_weights_do_not_move_at_a_small_lr_but_fp32_masters_do() -> None:
    # Issue 36 item 7 (the preflight's _update_below_rounding). AdamW moves each weight by ≈ lr per
    # step; bf16 (8 significant bits) rounds a weight in [2^e, 2^(e+1)) to steps of 2^(e-7), so a step
    # of 1e-6 is lost unless half that spacing, 2^(e-8), is below 1e-6: e ≤ -12, |w| < 2^-11 ≈ 4.9e-4,
    # i.e. P(|w| < 4.9e-4) ≈ 2 × 4.9e-4 / (0.02 √(2π)) ≈ 2% of N(0, 0.02²) weights. In fp32 (24
    # bits) the spacing near 0.02 is ≈ 2e-9: every weight moves.
    assert _fraction_changed(torch.bfloat16, lr=1e-6) < 0.5
    assert _fraction_changed(torch.float32, lr=1e-6) > 0.9
    # above the floor (1e-3 ≫ 3.9e-5) bf16 weights move too: |w| up to ≈ 0.25 has half-spacing < 1e-3
    assert _fraction_changed(torch.bfloat16, lr=1e-3) > 0.9
