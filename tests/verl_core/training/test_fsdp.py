"""FSDP2 and DeepSpeed ZeRO-2 with 2 processes (gloo, CPU) follow the same loss trajectory as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.slow
@pytest.mark.skipif(
    not deepspeed_available(), reason="deepspeed not installed (pip install 'verl-flow[deepspeed]')"
)
def test_deepspeed_zero2_two_processes_match_single(tmp_path: Path) -> None:
    # first use JIT-compiles DeepSpeed's shared-memory comm op (~80 s here, cached afterwards)
    out = tmp_path / "ds.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    worker = Path(fsdp_worker.__file__).with_name("deepspeed_worker.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
    ]
    proc = subprocess.run([*cmd, str(out)], capture_output=True, text=True, timeout=500, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(out.read_text())["losses"]
    for a, b in zip(losses, fsdp_worker.single(), strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
