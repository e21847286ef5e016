"""Which rollout engine each rank of an SPMD job builds (``stages.floor.engines.build_rollout_engine``),
with the rank's topology faked and ``make_engine`` recorded (no engine starts): ``rollout.name=vllm``
and ``auto`` on CUDA give one engine per tensor-parallel group, on its first rank, pinned to the
group's devices; the other ranks hold a GroupMemberEngine. (Before: every rank started a vLLM
subprocess with no devices named, all on cuda:0.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import stages.floor.engines as engines
from tests.vllm_env import vllm_python
from verl_core.config import load_config
from verl_core.rollout.placement import CUDA_VISIBLE, GroupMemberEngine, Topology


class Policy(torch.nn.Module):
    """Stands for the policy: moved to any device without allocating."""

    def to(self, *args: Any, **kwargs: Any) -> Policy:  # type: ignore[override]
        return self


def built(monkeypatch: pytest.MonkeyPatch, rank: int, overrides: list[str]) -> tuple[Any, list[Any]]:
    """What rank ``rank`` of 4 processes on one node builds on CUDA: (engine, make_engine calls)."""
    calls: list[Any] = []
    monkeypatch.setattr(engines, "world_size", lambda: 4)
    monkeypatch.setattr(engines, "current_topology", lambda: Topology(rank, 4, rank, 4, None, (0, 1)))
    monkeypatch.setattr(
        engines, "make_engine", lambda name, lm, tok, **kw: calls.append((name, kw)) or "engine"
    )
    spmd = ["trainer.n_gpus_per_node=4", "actor.strategy=fsdp2", "rollout.share_weights=false"]
    cfg = load_config(None, [*spmd, *overrides])
    return engines.build_rollout_engine(cfg, Policy(), None, torch.device("cuda")), calls


@pytest.mark.parametrize("name", ["vllm", "auto"])
def test_one_pinned_engine_per_tensor_parallel_group(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # auto on CUDA is vLLM (where its environment exists): the same placement
    overrides = [
        f"rollout.name={name}",
        "rollout.tensor_parallel_size=2",
        f"rollout.vllm_python={vllm_python()}",
    ]
    for rank, devices in ((0, "0,1"), (2, "2,3")):
        engine, calls = built(monkeypatch, rank, overrides)
        assert engine == "engine" and [c[0] for c in calls] == ["vllm"]
        assert calls[0][1]["env"][CUDA_VISIBLE] == devices
    for rank in (1, 3):
        engine, calls = built(monkeypatch, rank, overrides)
        assert isinstance(engine, GroupMemberEngine) and engine.tensor_parallel_size == 2 and calls == []


def test_hf_engines_one_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # the HF engine has no tensor parallelism: every rank builds its own, nothing pinned
    engine, calls = built(monkeypatch, 1, ["rollout.name=hf"])
    assert engine == "engine" and [c[0] for c in calls] == ["hf"] and "env" not in calls[0][1]


def test_every_rank_waits_for_every_engine_and_a_failed_start_fails_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # one all-gather after the engines start: a group member waits there (it loads nothing onto the
    # devices its group's engine is measuring), and learns when another rank's engine failed to start
    overrides = [
        "rollout.name=vllm",
        "rollout.tensor_parallel_size=2",
        f"rollout.vllm_python={vllm_python()}",
    ]
    gathered: list[list[Any]] = []

    def others_failed(items: list[Any]) -> list[Any]:
        gathered.append(list(items))
        return ["rank 2: rollout.gpu_memory_utilization: no room", *items]

    monkeypatch.setattr(engines, "all_gather", others_failed)
    with pytest.raises(RuntimeError, match=r"1 rank\(s\): rank 2: rollout.gpu_memory_utilization"):
        built(monkeypatch, 1, overrides)  # rank 1: a group member, no engine of its own
    assert gathered == [[None]]

    # the rank whose engine failed raises its own error, after the others know
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("no room on cuda:0")

    gathered.clear()
    monkeypatch.setattr(engines, "all_gather", lambda items: gathered.append(list(items)) or list(items))
    monkeypatch.setattr(engines, "world_size", lambda: 4)
    monkeypatch.setattr(engines, "current_topology", lambda: Topology(0, 4, 0, 4, None, (0, 1)))
    monkeypatch.setattr(engines, "make_engine", refuse)
    cfg = load_config(
        None, ["trainer.n_gpus_per_node=4", "actor.strategy=fsdp2", "rollout.share_weights=false", *overrides]
    )
    with pytest.raises(ValueError, match="no room on cuda:0"):
        engines.build_rollout_engine(cfg, Policy(), None, torch.device("cuda"))
    assert gathered == [["rank 0: no room on cuda:0"]]
