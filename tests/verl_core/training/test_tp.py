"""Tensor parallelism (FSDP2 strategy, 2-D ``("dp", "tp")`` mesh): TP=2 on 2 gloo ranks gives the same
losses and weights as one process, for SFT steps (Qwen2 and Llama) and one GRPO iteration; a TP
degree that does not divide the heads or the world size is a clear ConfigError.

Tolerance: the row-parallel o/down projections sum partial products across ranks in another order
than one matmul, so activations differ by float32 round-off (~1e-7); AdamW's update m/√v is about
±lr wherever a gradient is tiny, so such round-off can move an element by ~1e-5 of the largest
weight after a few steps at lr 1e-2. Measured: SFT losses rel 6e-8 (Qwen2) and 1e-7 (Llama),
weights max|Δ|/max|w| 3.0e-6 (Qwen2), 1.1e-5 (Llama); GRPO weights 5.6e-6; dp 2 × tp 2 (4 ranks)
SFT weights 3.2e-6. Asserted: losses rel 1e-5, SFT weights ≤ 5e-5. GRPO weights ≤ 1e-4: measured
2.0e-5 once the LM head ran on response rows only, 4.1e-5 once the first mini-batch's old log-probs
came from its own forward (23 Nov 2026; each side's own round-off enters the ratio of that step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.verl_core.training import fsdp_worker, tp_worker
from tests.verl_core.training import test_ppo_iteration as rl
from tests.verl_core.training.test_fsdp_checkpoint import relative_max_diff
from verl_core.errors import ConfigError
from verl_core.models.packed import PackedCausalLM
from verl_core.training.distributed import FSDP2Strategy, check_tp_divides, full_model_state
from verl_core.training.engine import SingleStrategy, TrainEngine
from verl_core.training.ppo import PPOModels

REPO = Path(__file__).resolve().parents[3]


def test_tp_must_divide_heads_kv_heads_and_mlp() -> None:
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    check_tp_divides(config, 2)  # 4/2, 2/2, 64/2: fine
    # tp 4: 4 query heads split, but 2 key/value heads cannot be
    with pytest.raises(ConfigError, match="num_key_value_heads=2") as err:
        check_tp_divides(config, 4)
    assert "num_attention_heads" not in str(err.value)
    with pytest.raises(ConfigError, match="num_attention_heads=4, num_key_value_heads=2"):
        check_tp_divides(config, 3)


def test_tp_must_divide_the_world_size() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="tensor_parallel_size=2 must divide the world size 1"):
            FSDP2Strategy("cpu", tp_size=2)
        one = FSDP2Strategy("cpu")  # world 1: dp 1 × tp 1
        assert (one.rank, one.world_size, one.dp_rank, one.dp_size, one.tp_size) == (0, 1, 0, 1, 1)
    finally:
        dist.destroy_process_group()


def single_sft(architecture: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = TrainEngine(fsdp_worker.make_model(architecture=architecture), fsdp_worker.OPTIM)
    return fsdp_worker.run_steps(engine, None, fsdp_worker.STEPS), full_model_state(engine.model)


def launch(out: Path, n_ranks: int, *args: str) -> dict[str, Any]:
    """tp_worker under torchrun on ``n_ranks`` gloo ranks; its result.json."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n_ranks)]
    proc = subprocess.run(
        [*cmd, str(Path(tp_worker.__file__)), str(out), *args],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    assert result["world_size"] == n_ranks
    return result


@pytest.mark.slow
def test_tp2_matches_one_process_for_sft_and_grpo(tmp_path: Path) -> None:
    result = launch(tmp_path, 2)
    # q_proj (32 → 32) is split by output rows over tp: 16 rows per rank (dp of 1 shards nothing)
    assert result["q_proj_local_shape"] == [16, 32]
    assert "Shard(dim=0)" in result["q_proj_placements"]

    for arch in ("qwen2", "llama"):
        losses, weights = single_sft(arch)
        assert losses[0] > losses[-1]  # it learns
        assert result[f"sft_{arch}"] == pytest.approx(losses, rel=1e-5), arch
        rel_w = relative_max_diff(weights, torch.load(tmp_path / f"weights_sft_{arch}.pt"))
        rel_l = max(abs(a - b) / abs(b) for a, b in zip(result[f"sft_{arch}"], losses, strict=True))
        print(f"TP=2 SFT {arch}: losses rel {rel_l:.1e}, weights max|Δ|/max|w| {rel_w:.1e}")
        assert rel_w <= 5e-5, arch

    actor = PackedCausalLM(rl.tiny_lm())
    engine = TrainEngine(actor, rl.plain_optim(), SingleStrategy("cpu"))
    metrics = rl.run(PPOModels(actor, engine), rl.make_spec()).metrics
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy"):
        assert result["grpo"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    rel_w = relative_max_diff(full_model_state(actor), torch.load(tmp_path / "weights_grpo.pt"))
    print(f"TP=2 GRPO: weights max|Δ|/max|w| {rel_w:.1e}")
    assert rel_w <= 1e-4


@pytest.mark.slow
def test_dp2_by_tp2_matches_one_process(tmp_path: Path) -> None:
    # 4 ranks: both mesh dimensions > 1, so gradients are averaged over dp while q/k/v/o and the
    # MLP are split over tp, and the clipped norm combines the (dp) and (dp, tp) meshes' parts
    result = launch(tmp_path, 4, "2d")
    losses, weights = single_sft("qwen2")
    assert result["sft_qwen2"] == pytest.approx(losses, rel=1e-5)
    rel_w = relative_max_diff(weights, torch.load(tmp_path / "weights_sft_qwen2.pt"))
    print(f"dp=2 × tp=2 SFT qwen2: weights max|Δ|/max|w| {rel_w:.1e}")
    assert rel_w <= 5e-5
