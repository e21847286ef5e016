"""Joining the process group (issue 36 item 11): on CUDA the rank's device is set before the group is
made, with NCCL for CUDA tensors beside gloo for CPU ones; gloo alone on CPU. The platform is a
recording fake: nothing here needs a GPU or a second process."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from verl_core.training.distributed import init_distributed


def fake_platform(monkeypatch: pytest.MonkeyPatch, local_rank: int = 1) -> list[tuple[Any, ...]]:
    """torchrun's environment for rank 3 of 4 (local rank ``local_rank``), and recording fakes of
    ``torch.cuda.set_device`` / ``torch.distributed.init_process_group``; returns the calls in order."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    joined: list[bool] = []

    def init_process_group(backend: str, timeout: timedelta | None = None, **kw: Any) -> None:
        calls.append(("init_process_group", backend, timeout))
        joined.append(True)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(dist, "get_rank", lambda *a: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 4)
    return calls


def test_cuda_sets_the_local_device_then_joins_with_nccl_and_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_platform(monkeypatch, local_rank=1)
    assert init_distributed("cuda", timeout_s=60) == (3, 4)
    # the old code joined with "nccl" alone, then set the device
    assert calls == [
        ("set_device", 1),
        ("init_process_group", "cpu:gloo,cuda:nccl", timedelta(seconds=60)),
    ]


def test_cpu_joins_with_gloo_and_sets_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_platform(monkeypatch)
    assert init_distributed("cpu") == (3, 4)
    assert calls == [("init_process_group", "gloo", None)]  # None: torch's default timeout


def test_a_joined_process_only_sets_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_platform(monkeypatch, local_rank=2)
    init_distributed("cuda")
    init_distributed("cuda")  # a stage inside the launcher's worker joins again: no second group
    assert [c[0] for c in calls] == ["set_device", "init_process_group", "set_device"]


def test_without_torchrun_a_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fake_platform(monkeypatch)
    monkeypatch.delenv("WORLD_SIZE")
    assert init_distributed("cuda") == (0, 1)
    assert calls == []
