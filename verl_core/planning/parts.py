"""What a memory plan is made of: components, a process's use of one memory pool per phase, the plan
(:func:`verl_core.planning.memory.plan_memory` fills them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from verl_core.planning.geometry import Geometry


@dataclass(frozen=True)
class Component:
    """``nbytes`` of one thing a process holds; ``shared``: the same pages are counted by another
    entry of the plan (staged weights the engine maps), left out of a pool's sum."""

    name: str
    nbytes: int
    formula: str
    shared: bool = False


Parts = tuple[Component, ...]


@dataclass(frozen=True)
class ProcessMemory:
    """One process's use of one memory pool (``cpu``: the machine's RAM; ``cuda``: one GPU), per phase
    of the run: ``phases[name]`` lists every component live at that phase's peak; a phase it has no
    entry for holds ``idle``. ``count``: processes like this one drawing on the same pool."""

    name: str
    role: str  # "trainer" | "vllm" | "staging"
    pool: str  # "cpu" | "cuda"
    idle: Parts
    phases: Mapping[str, Parts] = field(default_factory=dict)
    count: int = 1

    def at(self, phase: str, *, pooled: bool = False) -> int:
        """Bytes held at ``phase``; ``pooled``: without ``shared`` components."""
        parts = self.phases.get(phase, self.idle)
        return sum(c.nbytes for c in parts if not (pooled and c.shared))

    @property
    def peak_phase(self) -> str:
        """The phase it holds most at (``idle`` when no phase holds more than ``idle``)."""
        best = max(self.phases, key=self.at, default="idle")
        return best if self.at(best) > self.at("idle") else "idle"

    @property
    def peak_bytes(self) -> int:
        return self.at(self.peak_phase)

    def components(self, phase: str | None = None) -> Parts:
        return self.phases.get(phase or self.peak_phase, self.idle)


@dataclass(frozen=True)
class MemoryPlan:
    processes: tuple[ProcessMemory, ...]
    geometry: Geometry

    def pool_at(self, pool: str, phase: str) -> int:
        """Bytes the processes on ``pool`` hold together at ``phase`` (each times its ``count``,
        ``shared`` components left out)."""
        return sum(p.at(phase, pooled=True) * p.count for p in self.processes if p.pool == pool)

    def pool_need(self, pool: str) -> tuple[int, str]:
        """``(bytes, phase)``: the most the processes on ``pool`` hold at once, over the phases."""
        names = {p for proc in self.processes for p in proc.phases} | {"idle"}
        best = max(names, key=lambda ph: self.pool_at(pool, ph))
        return self.pool_at(pool, best), best

    @property
    def pools(self) -> list[str]:
        return sorted({p.pool for p in self.processes})
