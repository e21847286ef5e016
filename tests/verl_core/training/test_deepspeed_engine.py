"""How the DeepSpeed engine joins the process group (verl_core/training/deepspeed_engine.py), the
joins recorded, ``deepspeed`` a stand-in module and the platform faked: our one join first
(``init_distributed``: under torchrun the CUDA device set from LOCAL_RANK, then cpu:gloo + cuda:nccl),
then DeepSpeed's, which reuses the group. Calling ``deepspeed.init_distributed`` alone joined NCCL
only, before any device was set."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from verl_core.training import deepspeed_engine
from verl_core.training.deepspeed_engine import DeepSpeedTrainEngine
from verl_core.training.engine import OptimSpec

OPTIM = OptimSpec(
    lr=1e-3, weight_decay=0.0, warmup_steps=0, total_steps=1, scheduler="constant", grad_clip=1.0
)


class _Joined(Exception):
    """Ends the engine's construction once both joins are recorded."""


@pytest.mark.parametrize(("cuda", "joins"), [(True, ("cuda", "nccl")), (False, ("cpu", "gloo"))])
def test_our_join_comes_before_deepspeeds(
    monkeypatch: pytest.MonkeyPatch, cuda: bool, joins: tuple[str, str]
) -> None:
    calls: list[tuple[str, str]] = []

    def ours(device_type: str) -> tuple[int, int]:
        calls.append(("init_distributed", device_type))
        return 0, 1

    def deepspeeds(dist_backend: str) -> None:
        calls.append(("deepspeed.init_distributed", dist_backend))
        raise _Joined

    deepspeed = types.ModuleType("deepspeed")
    deepspeed.init_distributed = deepspeeds  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", deepspeed)
    monkeypatch.setattr(deepspeed_engine, "require", lambda needs: None)  # installed or not
    monkeypatch.setattr(deepspeed_engine, "_skip_shm_comm_op", lambda: None)  # DeepSpeed's CPU op table
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(deepspeed_engine, "init_distributed", ours, raising=False)
    with pytest.raises(_Joined):
        DeepSpeedTrainEngine(nn.Linear(2, 2), OPTIM, zero_stage=2)
    device_type, backend = joins
    assert calls == [("init_distributed", device_type), ("deepspeed.init_distributed", backend)]
