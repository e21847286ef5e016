"""Weight syncs of an SPMD job's engines on one node (verl_core.rollout.weight_sync.staged_weights):
``/dev/shm`` must hold every engine's sync at once, a ``/dev/shm`` that fills up mid-sync (ENOSPC) is
given up for the disk without losing the sync, and tensors are staged in the engine's compute dtype.
``/dev/shm`` is played by a directory under tmp_path, ``os.statvfs`` by a fake."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.verl_core.rollout.test_weight_sync_staging import FakeStatvfs
from verl_core.rollout import weight_sync
from verl_core.rollout.weight_sync import staged_names, staged_weights

MiB = 1 << 20


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """/dev/shm = tmp_path/shm with 100 MiB free of 128 MiB."""
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setattr(weight_sync, "SHM", str(path))
    monkeypatch.setattr(weight_sync, "_warned", [])
    real = os.statvfs
    fake = FakeStatvfs(4096, 128 * MiB // 4096, 100 * MiB // 4096)
    monkeypatch.setattr(os, "statvfs", lambda p: fake if str(p) == str(path) else real(p))
    return path


def weights(mib: int) -> list[tuple[str, torch.Tensor]]:
    """``mib`` MiB of float32 in one tensor, and a small int64 buffer."""
    return [("w", torch.zeros(mib * MiB // 4)), ("steps", torch.arange(4))]


def test_one_node_s_syncs_must_fit_in_shm_together(shm: Path) -> None:
    # one sync of 40 MiB (+1/16 headroom: 42.5 MiB) fits in 100 MiB free; two engines' fit (85 MiB);
    # eight tp=1 engines of one node syncing at once need 340 MiB: this one stages on disk
    with staged_weights(weights(40), 64 * MiB, syncs_per_node=2) as directory:
        assert Path(directory).parent == shm
    with staged_weights(weights(40), 64 * MiB, syncs_per_node=8) as directory:
        assert Path(directory).parent == Path(tempfile.gettempdir())
        assert sorted(staged_names(directory)) == ["steps", "w"]


def test_shm_filling_up_mid_sync_moves_the_sync_to_disk_once_said(
    shm: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # another writer filled /dev/shm after its free space was read: the bucket write fails with ENOSPC
    real = weight_sync.write_safetensors
    written: list[Path] = []

    def save_file(tensors: Any, filename: str, *args: Any, **kwargs: Any) -> None:
        if Path(filename).is_relative_to(shm):
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        written.append(Path(filename))
        real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(weight_sync, "write_safetensors", save_file)
    with (
        caplog.at_level(logging.WARNING, logger=weight_sync.__name__),
        staged_weights(weights(1), 64 * MiB) as directory,
    ):
        assert Path(directory).parent == Path(tempfile.gettempdir())
        assert sorted(staged_names(directory)) == ["steps", "w"]
    assert not list(shm.iterdir())  # the half-written /dev/shm directory is gone
    assert not Path(directory).exists()  # and the disk one once the engine has read it
    assert [r.message.count("--shm-size") for r in caplog.records] == [1]


def test_another_os_error_is_raised(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def save_file(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(weight_sync, "write_safetensors", save_file)
    with pytest.raises(PermissionError), staged_weights(weights(1), 64 * MiB):
        pass


def test_floating_tensors_are_staged_in_the_engine_s_compute_dtype(shm: Path) -> None:
    # fp32 masters of a bf16-compute policy: 4 MiB of float32 stage as 2 MiB of bfloat16 (vLLM would
    # cast them on load with the same rounding); integer tensors stay as they are
    masters = [("w", torch.tensor([1.0, 1.0 + 2**-9, 3.0])), ("steps", torch.arange(4))]
    with staged_weights(masters, 64 * MiB, dtype=torch.bfloat16) as directory:
        staged = load_file(next(Path(directory).glob("*.safetensors")))
    assert staged["w"].dtype == torch.bfloat16 and staged["steps"].dtype == torch.int64
    # 1 + 2^-9 is half a bf16 step above 1 (step 2^-8 there): rounds to even, 1.0
    assert staged["w"].tolist() == [1.0, 1.0, 3.0]
    assert weight_sync.staged_bytes(torch.zeros(MiB), torch.bfloat16) == 2 * MiB
