"""Where the pipeline runs its GPU-heavy stages, chosen once per run by ``execution.mode``:

    local        in this process: the stage flows of :mod:`flows.gpu` and :func:`flows.rl.rl_loop`
                 as sub-flows of the pipeline
    deployments  as flow runs of their deployments on the gpu pool, waited for (:mod:`flows.dispatch`)

Both take the same arguments and return the same results (the remote ones read them back from the
shared store), so the pipeline calls ``gpu.sft(...)``, ``gpu.rl(...)``, ``gpu.export(...)`` without
asking again where they run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from flows.dispatch import remote_export, remote_rl_loop, remote_sft
from flows.gpu import export_flow, sft_flow
from flows.rl import rl_loop
from verl_core.config import ExecutionConfig, VerlFlowConfig
from verl_core.runtime.run import RunContext

if TYPE_CHECKING:
    from stages.floor.lineage import RLResult


class GpuStages(NamedTuple):
    """The GPU-heavy stages of one placement; each takes the run context, the config and the
    template_pack manifest URI."""

    sft: Callable[[RunContext, VerlFlowConfig, str], str]  # → the sft stage's manifest URI
    rl: Callable[[RunContext, VerlFlowConfig, str, str | None], RLResult]  # (+ the sft URI) → the RL result
    export: Callable[[RunContext, VerlFlowConfig, str], str]  # → the latest checkpoint's export URI


def _export_latest(ctx: RunContext, config: VerlFlowConfig, template_pack_uri: str) -> str:
    return export_flow(ctx, config, template_pack_uri, None)  # None: the latest checkpoint


PLACEMENTS: dict[str, GpuStages] = {
    "local": GpuStages(sft_flow, rl_loop, _export_latest),
    "deployments": GpuStages(remote_sft, remote_rl_loop, remote_export),
}


def gpu_stages(execution: ExecutionConfig) -> GpuStages:
    """The stages of ``execution.mode``'s placement."""
    return PLACEMENTS[execution.mode]
