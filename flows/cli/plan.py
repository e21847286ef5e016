"""``verl-flow plan CONFIG [OVERRIDES]``: the memory each process of the run needs, by component,
against what the machine has, and the seconds each phase of an iteration is expected to take.

Memory: :func:`verl_core.planning.memory.plan_memory` (formulas in its docstring); capacity and the
knob that fixes a plan that does not fit: :mod:`verl_core.planning.capacity`. Seconds:
:func:`verl_core.planning.cost.predict_seconds` on the device the config names (CPU: a matmul rate
measured here; GPU: the published peak of ``--gpu`` or of the GPU present). Exit 0 when the run
fits, 1 with one line (pool, need, how much over, the knob) when it cannot (its floor plan over the
capacity, :mod:`verl_core.planning.capacity`), 2 for a bad config.
``verl-flow run`` refuses the same runs before any work (:func:`check_fits`; ``trainer.refuse_unfit``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from flows.cli.common import ConfigArg, OverridesArg, err, fail, load, out, print_table
from verl_core.errors import ConfigError

if TYPE_CHECKING:
    from verl_core.config import VerlFlowConfig
    from verl_core.planning.capacity import Capacity
    from verl_core.planning.memory import MemoryPlan

GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu", help="Plan for a machine with this GPU (e.g. H100, H200, A100); its RAM: --ram-gib"
    ),
]


def plan_cmd(
    config: ConfigArg,
    overrides: OverridesArg = None,
    gpu: GpuOpt = None,
    gpu_memory_gib: Annotated[
        float | None, typer.Option("--gpu-memory-gib", help="One GPU's memory in GiB (instead of --gpu)")
    ] = None,
    ram_gib: Annotated[
        float | None, typer.Option("--ram-gib", help="RAM the run may use in GiB (default: available now)")
    ] = None,
) -> None:
    """Plan CONFIG with OVERRIDES: memory per process and device against the machine's, seconds per
    phase of an iteration. Exit 1 with one line (and the knob that fixes it) when the run cannot fit
    even with one-sample micro-batches (``verl-flow run`` refuses it); a warning when only its
    full-length plan does not fit."""
    cfg = load(config, overrides)
    from verl_core.planning.capacity import machine_capacity

    try:
        capacity = machine_capacity(ram_gib=ram_gib, gpu=gpu, gpu_memory_gib=gpu_memory_gib)
        plan = _plan(cfg, capacity)
    except ConfigError as e:
        fail(e, 2)
    _print_memory(plan, _plan(cfg, capacity, floor=True), capacity)
    _print_seconds(cfg, plan, gpu, capacity)
    warning = unfit_line(cfg, capacity, floor=False)
    refusal = unfit_line(cfg, capacity, floor=True)
    if refusal is not None:
        fail(refusal, 1)
    if warning is not None:
        err.print(f"[yellow]warning:[/] at full lengths {escape(warning)}", highlight=False, soft_wrap=True)


def _plan(cfg: VerlFlowConfig, capacity: Capacity, *, floor: bool = False) -> MemoryPlan:
    from verl_core.planning.memory import plan_memory

    return plan_memory(cfg, gpu_bytes=capacity.pools.get("cuda"), floor=floor)


def unfit_line(cfg: VerlFlowConfig, capacity: Capacity, *, floor: bool) -> str | None:
    """The one line of a run that does not fit ``capacity``, naming the knob that fixes it; None when
    it fits. ``floor``: its floor plan, and only beyond the plan's error margin (a refusal); else its
    full-length plan (a warning)."""
    from verl_core.planning.capacity import fixes, refusal_line, shortfalls

    found = [s for s in shortfalls(_plan(cfg, capacity, floor=floor), capacity) if s.refused or not floor]
    if not found:
        return None
    worst = max(found, key=lambda s: s.need - s.have)
    knobs = fixes(cfg, lambda c: _plan(c, capacity, floor=floor), capacity, worst.pool)
    return refusal_line(worst, knobs, capacity.source)


def check_fits(cfg: VerlFlowConfig) -> str | None:
    """What ``verl-flow run`` checks before any work: the one line of a run whose floor plan exceeds
    this machine's memory beyond the plan's margin; None when it fits, when ``trainer.refuse_unfit`` is
    off, when the stages run elsewhere (deployments) or the model's geometry cannot be read here."""
    if not cfg.trainer.refuse_unfit or cfg.execution.mode != "local":
        return None
    from verl_core.planning.capacity import machine_capacity

    capacity = machine_capacity()
    if cfg.trainer.device == "cuda" and "cuda" not in capacity.pools:
        return None  # no GPU here: the run fails on its device, not on a plan
    try:
        line = unfit_line(cfg, capacity, floor=True)
    except ConfigError:
        return None  # a pretrained model whose config.json is not reachable yet: its load says why
    return None if line is None else f"{line} (trainer.refuse_unfit=false runs it anyway)"


def _print_memory(plan: MemoryPlan, floor: MemoryPlan, capacity: Capacity) -> None:
    from verl_core.planning.capacity import gib

    g = plan.geometry
    out.print(
        f"model: {g.n_params / 1e6:,.1f}M parameters ({g.num_layers} layers, hidden {g.hidden_size}, "
        f"vocabulary {g.vocab_rows:,})",
        highlight=False,
    )
    for proc in plan.processes:
        phase = proc.peak_phase
        title = escape(f"{proc.name} [{proc.pool}]: peak {gib(proc.peak_bytes)} at {phase}")
        table = Table("component", "GiB", "formula", title=title, title_justify="left")
        for comp in proc.components(phase):
            table.add_row(comp.name, f"{comp.nbytes / 2**30:.3f}", comp.formula)
        if len(proc.phases) > 1:
            table.add_row("", "", "")
            for name in proc.phases:
                table.add_row(f"total at {name}", f"{proc.at(name) / 2**30:.3f}", "")
        print_table(table)
    totals = Table(
        "memory", "needs (full lengths)", "at", "at least (1-sample micro-batches)", "has", "source",
        title="total vs capacity", title_justify="left",
    )  # fmt: skip
    for pool in plan.pools:
        need, phase = plan.pool_need(pool)
        have = capacity.pools.get(pool)
        source = capacity.source.get(pool, "unknown (--gpu / --gpu-memory-gib, --ram-gib)")
        least = gib(floor.pool_need(pool)[0])
        totals.add_row(pool, gib(need), phase, least, gib(have) if have is not None else "?", source)
    print_table(totals)


def _print_seconds(cfg: VerlFlowConfig, plan: MemoryPlan, gpu: str | None, capacity: Capacity) -> None:
    """Seconds per phase from the cost model (:func:`verl_core.planning.cost.predict_seconds`) at the
    rate of the device the config names: measured here for the CPU, published for a GPU; the
    checkpoint's page cache taken from the RAM the plan leaves free then (:func:`free_at_checkpoint`)."""
    from verl_core.planning import cost

    if cfg.trainer.device == "cuda":
        name = gpu or _cuda_name()
        rate = cost.gpu_peak_flops(name.upper()) if name else None
        if rate is None:
            out.print(f"seconds per phase: no published rate for GPU {name!r}: name one with --gpu")
            return
        calibration, device = cost.GPU_CALIBRATION, f"{name}, published peak"
    else:
        rate, calibration = cost.measure_cpu_matmul_rate(), cost.CPU_CALIBRATION
        device = f"this CPU, {rate / 1e9:,.0f} GFLOP/s measured"
    seconds = cost.predict_seconds(
        cfg, plan.geometry, rate, calibration, free_bytes=free_at_checkpoint(plan, capacity)
    )
    title = f"expected seconds per RL iteration ({device})"
    table = Table("phase", "seconds", title=title, title_justify="left")
    for phase, s in seconds.items():
        table.add_row(phase if phase != "iteration" else "iteration (total)", f"{s:,.2f}")
    print_table(table)


def free_at_checkpoint(plan: MemoryPlan, capacity: Capacity) -> int | None:
    """The host RAM left free while a checkpoint is saved: what the machine has (``MemAvailable``,
    reclaimable cache included) less what the plan's processes hold then; None when unknown."""
    have = capacity.pools.get("cpu")
    if have is None:
        return None
    return max(have - plan.pool_at("cpu", "checkpoint"), 0)


def _cuda_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None
