"""What the machine has, whether a :class:`~verl_core.planning.memory.MemoryPlan` fits in it, and which
config knob would make a plan that does not fit, fit.

Capacity: the host's RAM available now (``MemAvailable`` of ``/proc/meminfo``: free plus reclaimable
cache, what a new run can take), and per GPU the free memory ``torch.cuda.mem_get_info`` measures; for
a GPU config planned where there is no GPU, the published memory of the GPU named (:data:`GPU_MEMORY_GIB`).

Two plans of a run: at the config's full lengths and token budgets (the bound: every sample as long as
it may be, every micro-batch filled), and its floor (``plan_memory(floor=True)``: micro-batches of one
full-length sample, the least the config allows). A run is refused (``verl-flow run``, exit 1 of
``verl-flow plan``) only when even its floor exceeds the capacity by more than :data:`REFUSE_MARGIN` of
its need (the plan's error against measured peaks, benchmarks/RESULTS.md): a run that could fit is never
refused. A bound over the capacity is a warning with the same line (the run may fit on shorter samples).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from verl_core.errors import ConfigError
from verl_core.planning.memory import GIB, MemoryPlan

if TYPE_CHECKING:
    from verl_core.config.schema import VerlFlowConfig

# Refuse only when need × (1 − margin) > capacity: the plan's error bound against measured peaks.
REFUSE_MARGIN = 0.15
# published memory of data-centre and workstation GPUs (GiB as the vendors state GB; a plan's bound)
GPU_MEMORY_GIB: dict[str, float] = {
    "H200": 141, "H100": 80, "H100-PCIE": 80, "H800": 80, "GH200": 96, "B200": 180, "A100": 80,
    "A100-40GB": 40, "A800": 80, "L40S": 48, "L40": 48, "A10G": 24, "A10": 24, "L4": 24, "T4": 16,
    "V100": 32, "RTX-4090": 24, "RTX-3090": 24, "A6000": 48, "MI300X": 192, "MI250X": 128,
}  # fmt: skip


@dataclass(frozen=True)
class Capacity:
    """Bytes each memory pool has for the run: ``cpu`` (RAM) and ``cuda`` (one GPU), where known."""

    pools: Mapping[str, int]
    source: Mapping[str, str]  # where each figure comes from


def host_ram_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (psutil's figure where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def gpu_memory(name: str | None) -> tuple[int, str] | None:
    """``(bytes, source)`` of one GPU: the free memory CUDA measures, else the published memory of
    ``name`` (a key of :data:`GPU_MEMORY_GIB`, case-insensitive); None where neither is known."""
    if name is not None:
        key = name.upper().replace(" ", "-")
        if key not in GPU_MEMORY_GIB:
            raise ConfigError(f"--gpu: unknown GPU {name!r}; known: {', '.join(GPU_MEMORY_GIB)}")
        return int(GPU_MEMORY_GIB[key] * GIB), f"{key}, published"
    try:
        import torch

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            return int(free), f"{torch.cuda.get_device_name()}, free now"
    except (ImportError, RuntimeError):
        pass
    return None


def machine_capacity(
    *, ram_gib: float | None = None, gpu: str | None = None, gpu_memory_gib: float | None = None
) -> Capacity:
    """This machine's :class:`Capacity`, each figure replaced by the one given. A GPU named (``gpu``) is
    another machine's: its RAM is unknown (not checked) unless ``ram_gib`` says it."""
    pools: dict[str, int] = {}
    source: dict[str, str] = {}
    if ram_gib is not None:
        pools["cpu"], source["cpu"] = int(ram_gib * GIB), "given"
    elif gpu is None:
        pools["cpu"], source["cpu"] = host_ram_available(), "MemAvailable now"
    if gpu_memory_gib is not None:
        pools["cuda"], source["cuda"] = int(gpu_memory_gib * GIB), "given"
    else:
        found = gpu_memory(gpu)
        if found is not None:
            pools["cuda"], source["cuda"] = found
    return Capacity(pools, source)


@dataclass(frozen=True)
class Shortfall:
    """One pool the plan does not fit: what it needs (at which phase), what it has."""

    pool: str
    need: int
    have: int
    phase: str
    largest: str  # the process holding most of it

    @property
    def refused(self) -> bool:
        """Over even after the plan's error margin (:data:`REFUSE_MARGIN`)."""
        return self.need * (1 - REFUSE_MARGIN) > self.have


def shortfalls(plan: MemoryPlan, capacity: Capacity) -> list[Shortfall]:
    """The pools whose need exceeds their capacity (pools of unknown capacity are not checked)."""
    out = []
    for pool in plan.pools:
        have = capacity.pools.get(pool)
        need, phase = plan.pool_need(pool)
        if have is None or need <= have:
            continue
        on = [p for p in plan.processes if p.pool == pool]
        largest = max(on, key=lambda p: p.at(phase, pooled=True) * p.count)
        out.append(Shortfall(pool, need, have, phase, largest.name))
    return out


# Knobs a user turns to need less memory, tried in this order: each takes the config and returns the
# overrides to try (none where the knob is already turned or does not apply).
def _halvings(path: str, value: int, floor: int) -> list[list[str]]:
    out, v = [], value // 2
    while v >= floor:
        out.append([f"{path}={v}"])
        v //= 2
    return out


def _knobs(cfg: VerlFlowConfig) -> list[list[str]]:
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    a, ro, m = cfg.actor, cfg.rollout, cfg.model
    tries: list[list[str]] = []
    if not m.gradient_checkpointing:
        tries.append(["model.gradient_checkpointing=true"])
    if a.use_dynamic_bsz:
        tries += _halvings("actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu, seq)
    else:
        tries += _halvings("actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu, 1)
    if cfg.use_critic:
        tries += _halvings("critic.ppo_max_token_len_per_gpu", cfg.critic.ppo_max_token_len_per_gpu, seq)
    tries += _halvings("rollout.log_prob_max_token_len_per_gpu", ro.log_prob_max_token_len_per_gpu, seq)
    if ro.name in ("vllm", "auto"):
        kv = ro.kv_cache_gib if ro.kv_cache_gib is not None else ro.cpu_kv_cache_gib
        tries += [[f"rollout.kv_cache_gib={kv / k:g}"] for k in (2, 4)]
        tries += [[f"rollout.gpu_memory_utilization={ro.gpu_memory_utilization / 2:g}"]]
    if ro.name == "hf":
        tries += _halvings("rollout.max_batch_size", ro.max_batch_size, 1)
        if not ro.share_weights:
            tries.append(["rollout.share_weights=true"])
    if not m.lora_rank:
        tries.append(["model.lora_rank=16"])
    if m.dtype == "float32":  # half the weights and moments (the preflight refuses it where AdamW
        tries.append(["model.dtype=bfloat16"])  # steps would round away)
    if cfg.trainer.device == "cuda":
        if not a.param_offload and cfg.world_size > 1:  # fsdp2 runs under torch.distributed only
            tries.append(["actor.strategy=fsdp2", "actor.param_offload=true"])
        tries += [[f"trainer.n_gpus_per_node={k}", "actor.strategy=fsdp2"] for k in (2, 4, 8)]
    return tries


def fixes(
    cfg: VerlFlowConfig,
    replan: Callable[[VerlFlowConfig], MemoryPlan],
    capacity: Capacity,
    pool: str,
    *,
    most: int = 2,
) -> list[tuple[list[str], int]]:
    """Up to ``most`` knob settings (overrides, each with the pool's need after it) that bring ``pool``
    under its capacity, the mildest first (the first fitting value of each knob); when no single knob
    does, the first combination of knobs tried in order that does; empty when none does."""
    found: list[tuple[list[str], int]] = []
    seen: set[str] = set()
    tried: list[str] = []
    best: tuple[list[str], int] | None = None
    for overrides in _knobs(cfg):
        knob = overrides[0].split("=")[0]
        if knob in seen:
            continue
        need = _need(cfg, overrides, replan, pool)
        if need is None:
            continue
        if need <= capacity.pools[pool]:
            found.append((overrides, need))
            seen.add(knob)
            if len(found) == most:
                break
        elif knob not in {t.split("=")[0] for t in tried}:  # the combination: each knob's first value
            combined = _need(cfg, [*tried, *overrides], replan, pool)
            if combined is not None and (best is None or combined < best[1]):
                tried, best = [*tried, *overrides], ([*tried, *overrides], combined)
    if found:
        return found
    return [best] if best is not None and best[1] <= capacity.pools[pool] else []


def _need(
    cfg: VerlFlowConfig, overrides: list[str], replan: Callable[[VerlFlowConfig], MemoryPlan], pool: str
) -> int | None:
    """``pool``'s need with ``overrides`` applied; None where the config they make is invalid."""
    from verl_core.config.loader import with_overrides

    try:
        changed = with_overrides(cfg, overrides)
    except (ConfigError, ValueError):
        return None
    return replan(changed).pool_need(pool)[0]


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def refusal_line(short: Shortfall, found: list[tuple[list[str], int]], what: Mapping[str, Any]) -> str:
    """The one line of a run that cannot fit: pool, need, how much over, which knob fixes it."""
    where = {"cpu": "RAM", "cuda": "GPU memory"}[short.pool]
    line = (
        f"memory: the run needs {gib(short.need)} of {where} at its {short.phase} peak (mostly "
        f"{short.largest}), {gib(short.need - short.have)} over the {gib(short.have)} "
        f"{what.get(short.pool, 'available')}"
    )
    if not found:
        return line + "; no single knob brings it under: a machine with more memory"
    fix = " or ".join(f"{' '.join(o)} (→ {gib(n)})" for o, n in found)
    return f"{line}; fix: {fix}"
