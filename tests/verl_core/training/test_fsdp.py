"""FSDP2 and DeepSpeed ZeRO-1/2/3 with 2 processes (gloo, CPU) follow the same loss trajectory as one
process; a DeepSpeed checkpoint resumes the same trajectory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.verl_core.training import fsdp_worker
from verl_core.training.deepspeed_engine import deepspeed_available
from verl_core.training.distributed import rank_shard

REPO = Path(__file__).resolve().parents[3]


def test_rank_shards_cover_every_sequence_once_with_balanced_tokens() -> None:
    lengths = [7, 3, 12, 5, 9, 4, 6, 10]
    shards = [rank_shard(lengths, r, 2) for r in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(8))
    assert len(shards[0]) == len(shards[1]) == 4
    # 56 tokens: a perfect split is 28/28
    assert abs(sum(lengths[i] for i in shards[0]) - sum(lengths[i] for i in shards[1])) <= 2
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        rank_shard([1, 2], 0, 3)


@pytest.mark.slow
def test_fsdp2_two_processes_match_single(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(Path(fsdp_worker.__file__)), str(out)],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    single = fsdp_worker.single()
    assert len(result["losses"]) == fsdp_worker.STEPS
    assert single[0] > single[-1]  # it learns
    for a, b in zip(result["losses"], single, strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """deepspeed_worker's results: one torchrun launch, 2 gloo ranks, ZeRO 1/2/3 and two resumes."""
    if not deepspeed_available():
        pytest.skip("deepspeed not installed (pip install 'verl-flow[deepspeed]')")
    out = tmp_path_factory.mktemp("ds") / "ds.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    worker = Path(fsdp_worker.__file__).with_name("deepspeed_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(worker), str(out)], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def single_losses() -> list[float]:
    return fsdp_worker.single()


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_deepspeed_two_processes_match_single(
    deepspeed_run: dict[str, Any], single_losses: list[float], zero_stage: int
) -> None:
    assert deepspeed_run["world_size"] == 2
    losses = deepspeed_run[f"zero{zero_stage}"]["losses"]
    single = single_losses
    assert single[0] > single[-1]  # it learns
    for a, b in zip(losses, single, strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    # full_state_dict gathers every weight onto rank 0, the tied LM head included: a Qwen2 of hidden
    # 32, 2 layers, vocab 64, intermediate 64, 4 heads of 8 (2 kv heads) ->
    # embed 64*32 = 2048, twice (tied lm_head listed too); per layer q 32*32+32, k 16*32+16,
    # v 16*32+16, o 32*32, mlp 3*64*32, 2 norms of 32 = 1056+528+528+1024+6144+64 = 9344; final norm 32
    assert deepspeed_run[f"zero{zero_stage}"]["n_params"] == 2 * 2048 + 2 * 9344 + 32


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_checkpoint_resumes_the_same_trajectory(
    deepspeed_run: dict[str, Any], zero_stage: int
) -> None:
    # 2 steps, checkpoint (full weights + per-rank trainer state as bytes), a fresh model (other seed)
    # and engine loaded from it, 2 more steps: the same losses and weights as 4 steps in one go
    run, resumed = deepspeed_run[f"zero{zero_stage}"], deepspeed_run[f"zero{zero_stage}_resumed"]
    assert resumed["losses"] == pytest.approx(run["losses"], rel=1e-6, abs=0)
    assert resumed["same_keys"] and resumed["max_abs_diff"] <= 1e-6
    # one optimizer partition per rank (ZeRO-3: also the module's)
    assert sum("optim_states" in f for f in resumed["state_files"]) == 2
    assert resumed["other_world_size_error"] == (
        "DeepSpeed checkpoint made with world_size 1 cannot resume with world_size 2: its optimizer "
        "state is partitioned per rank (resume with the same setting)"
    )


@pytest.mark.slow
def test_deepspeed_zero3_trains_lora_adapters_only(deepspeed_run: dict[str, Any]) -> None:
    from tests.verl_core.training.deepspeed_worker import SAVE_AT, lora_model, train_steps
    from verl_core.training.engine import TrainEngine

    run = deepspeed_run["zero3_lora"]
    single = train_steps(TrainEngine(lora_model(), fsdp_worker.OPTIM), list(range(8)), SAVE_AT)
    for a, b in zip(run["losses"], single, strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert run["same_keys"]
    # all-linear LoRA on 2 layers × 7 projections: an A and a B each, and nothing else moves
    assert len(run["moved"]) == 2 * 7 * 2 and all("lora_" in k for k in run["moved"])
