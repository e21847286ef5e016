"""Where weight syncs are staged (verl_core.rollout.weight_sync): ``/dev/shm`` when its free space holds
the whole sync, else the system temp directory with one logged line naming the fix. ``/dev/shm`` is
played by a directory under tmp_path and ``os.statvfs`` by a fake (Docker's default: 64 MB)."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from verl_core.models.loading import ScratchSpec, scratch_config
from verl_core.rollout import weight_sync
from verl_core.rollout.weight_sync import (
    staged_names,
    staged_weights,
    staging_root,
    sync_bytes,
)

MiB = 1 << 20


class FakeStatvfs(NamedTuple):
    f_frsize: int
    f_blocks: int
    f_bavail: int


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], str]:
    """``set_shm(free, total)``: /dev/shm is tmp_path/shm with that free and total space; returns its path."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setattr(weight_sync, "SHM", str(path))
    monkeypatch.setattr(weight_sync, "_warned", [])
    real = os.statvfs

    def set_shm(free: int, total: int) -> str:
        fake = FakeStatvfs(4096, total // 4096, free // 4096)
        monkeypatch.setattr(os, "statvfs", lambda p: fake if str(p) == str(path) else real(p))
        return str(path)

    return set_shm


def test_a_sync_larger_than_shm_stages_on_disk_and_says_how_to_fix_it_once(
    shm: Callable[[int, int], str], caplog: pytest.LogCaptureFixture
) -> None:
    shm(60 * MiB, 64 * MiB)  # Docker's default /dev/shm, nearly empty
    with caplog.at_level(logging.WARNING, logger=weight_sync.__name__):
        # 1 GiB (a 0.5B model in bf16) does not fit in 60 MiB free
        assert staging_root(1 << 30) == tempfile.gettempdir()
        assert staging_root(1 << 30) == tempfile.gettempdir()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines  # once per process
    assert "--shm-size" in lines[0] and "--ipc=host" in lines[0] and "emptyDir" in lines[0]
    assert "60 MiB free of 64 MiB" in lines[0] and "1,024 MiB" in lines[0]


def test_a_sync_that_fits_stays_in_shm(
    shm: Callable[[int, int], str], caplog: pytest.LogCaptureFixture
) -> None:
    path = shm(60 * MiB, 64 * MiB)
    with caplog.at_level(logging.WARNING, logger=weight_sync.__name__):
        # 40 MiB + 1/16 headroom = 42.5 MiB ≤ 60 MiB free
        assert staging_root(40 * MiB) == path
        # 57 MiB + 1/16 = 60.56 MiB > 60 MiB: headers and other writers need room too
        assert staging_root(57 * MiB) == tempfile.gettempdir()
    assert len(caplog.records) == 1


def test_no_shm_stages_in_the_temp_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(weight_sync, "SHM", str(tmp_path / "absent"))
    assert staging_root(1) == tempfile.gettempdir()
    with staged_weights([("a", torch.zeros(4))], bucket_bytes=MiB) as directory:
        assert Path(directory).parent == Path(tempfile.gettempdir())


def test_staged_weights_sizes_the_sync_before_choosing_where(shm: Callable[[int, int], str]) -> None:
    weights = {"a": torch.zeros(MiB // 4), "b": torch.ones(MiB // 4)}  # 2 × 1 MiB in fp32
    path = shm(1 * MiB, 64 * MiB)  # 1 MiB free: the 2 MiB sync goes to disk
    with staged_weights(weights.items(), bucket_bytes=MiB) as directory:
        assert Path(directory).parent == Path(tempfile.gettempdir())
        assert staged_names(directory) == ["a", "b"]  # one bucket each
        assert len(list(Path(directory).glob("*.safetensors"))) == 2
    assert not Path(directory).exists()
    shm(64 * MiB, 64 * MiB)  # room: /dev/shm
    with staged_weights(weights.items(), bucket_bytes=MiB) as directory:
        assert Path(directory).parent == Path(path)
        assert staged_names(directory) == ["a", "b"]
    assert not Path(directory).exists()


def test_sync_bytes_counts_every_state_dict_tensor() -> None:
    # Qwen2, hidden 8, 1 layer, 2 heads (head_dim 4), 1 kv head, MLP 16, vocab 10, tied embeddings:
    #   embed_tokens 10·8 = 80, lm_head.weight (tied, staged as its own copy) 80
    #   q_proj 8·8 + 8 = 72, k_proj 4·8 + 4 = 36, v_proj 36, o_proj 8·8 = 64
    #   gate/up/down 3 · 8·16 = 384, two RMSNorms 8 + 8, the final norm 8
    #   = 80 + 80 + 72 + 36 + 36 + 64 + 384 + 16 + 8 = 776 parameters (rotary inv_freq is not persistent)
    config = scratch_config(ScratchSpec("qwen2", 8, 1, 2, 1, 16, 32), 10, eos_token_id=0, pad_token_id=0)
    assert sync_bytes(config, 4) == 776 * 4
    assert sync_bytes(config, 2) == 776 * 2
