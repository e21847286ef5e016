"""Rollout engine placement under torchrun (``verl_core.rollout.placement``): which ranks start an
engine and the devices / cores each engine's subprocess is pinned to, worked out by hand."""

from __future__ import annotations

import pytest

from verl_core.errors import ConfigError
from verl_core.rollout.base import RolloutEngine
from verl_core.rollout.placement import (
    CPU_BIND,
    CUDA_VISIBLE,
    ONE_PROCESS_WORLD,
    GroupMemberEngine,
    Topology,
    engine_placement,
    local_cores,
)


def topology(
    rank: int, world: int, per_node: int, visible: str | None = None, cpus: tuple[int, ...] = (0, 1)
) -> Topology:
    """Rank ``rank`` of ``world`` processes, ``per_node`` per node (rank = node · per_node + local)."""
    return Topology(rank, world, rank % per_node, per_node, visible, cpus)


def pins(world: int, per_node: int, tp: int, device: str, **kw: object) -> dict[int, str]:
    """rank → the pinning variable of the engine it owns (ranks owning none left out)."""
    out = {}
    for r in range(world):
        p = engine_placement(topology(r, world, per_node, **kw), tp, device)  # type: ignore[arg-type]
        if p.owner:
            out[r] = p.env[CUDA_VISIBLE if device == "cuda" else CPU_BIND]
    return out


def test_eight_gpus_tensor_parallel_two_four_engines_on_device_pairs() -> None:
    # groups (0,1) (2,3) (4,5) (6,7): the first rank of each starts the engine on its group's devices
    assert pins(8, 8, 2, "cuda") == {0: "0,1", 2: "2,3", 4: "4,5", 6: "6,7"}
    member = engine_placement(topology(5, 8, 8), 2, "cuda")
    assert (member.owner, member.group, member.ranks, dict(member.env)) == (False, 2, (4, 5), {})


def test_one_engine_per_gpu_without_tensor_parallelism() -> None:
    assert pins(4, 4, 1, "cuda") == {0: "0", 1: "1", 2: "2", 3: "3"}


def test_the_jobs_own_visible_devices_are_mapped() -> None:
    # the job sees physical GPUs 4-7: local rank i trains on cuda:i = physical 4 + i
    assert pins(4, 4, 1, "cuda", visible="4,5,6,7") == {0: "4", 1: "5", 2: "6", 3: "7"}
    assert pins(4, 4, 2, "cuda", visible="4,5,6,7") == {0: "4,5", 2: "6,7"}
    assert pins(2, 2, 1, "cuda", visible="GPU-a, GPU-b") == {0: "GPU-a", 1: "GPU-b"}  # UUIDs too
    with pytest.raises(ConfigError, match="lists 2 device"):
        engine_placement(topology(0, 4, 4, visible="4,5"), 1, "cuda")


def test_two_nodes_pin_by_local_rank() -> None:
    # 2 nodes × 4, tp 2: rank 6 is node 1's local rank 2 → its node's devices 2 and 3
    p = engine_placement(topology(6, 8, 4), 2, "cuda")
    assert (p.owner, p.group, p.ranks, p.env[CUDA_VISIBLE]) == (True, 3, (6, 7), "2,3")


def test_cpu_ranks_get_disjoint_cores() -> None:
    # 2 ranks on 2 cores: core 0 and core 1
    assert pins(2, 2, 1, "cpu", cpus=(0, 1)) == {0: "0", 1: "1"}
    # 2 ranks, tp 2, 4 cores: one engine, its two workers on ranks 0's and 1's cores
    assert pins(2, 2, 2, "cpu", cpus=(0, 1, 2, 3)) == {0: "0,1|2,3"}
    # the job's affinity with holes: 2 ranks on {2, 3, 6, 7}
    assert pins(2, 2, 1, "cpu", cpus=(7, 6, 3, 2)) == {0: "2,3", 1: "6,7"}


def test_local_cores_split_contiguously_and_share_when_scarce() -> None:
    # 8 cores over 3 ranks: boundaries at 0·8//3=0, 1·8//3=2, 2·8//3=5, 8
    assert [local_cores(range(8), r, 3) for r in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert [local_cores([0, 1], r, 3) for r in range(3)] == [[0], [1], [0]]  # round-robin


def test_engine_subprocess_is_a_world_of_its_own() -> None:
    env = engine_placement(topology(1, 2, 2), 1, "cpu").env
    assert {k: env[k] for k in ONE_PROCESS_WORLD} == {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
    }


def test_one_process_adds_nothing() -> None:
    p = engine_placement(Topology(0, 1, 0, 1, None, (0, 1)), 2, "cuda")
    assert (p.owner, p.group, p.ranks, dict(p.env)) == (True, 0, (0,), {})


def test_a_group_never_spans_nodes() -> None:
    with pytest.raises(ConfigError, match="does not divide the 3 processes per node"):
        engine_placement(topology(0, 6, 3), 2, "cuda")


def test_group_member_engine_records_versions_and_refuses_to_generate() -> None:
    engine = GroupMemberEngine(tensor_parallel_size=2)
    assert isinstance(engine, RolloutEngine) and not engine.shares_weights
    engine.load_weights([], 3)
    assert engine.policy_version == 3
    engine.load_adapter({}, 4)
    assert engine.policy_version == 4
    with pytest.raises(RuntimeError, match="holds no rollout engine"):
        engine.generate([[1, 2]])
