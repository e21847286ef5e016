"""The pipeline's GPU stages are placed once per run by ``execution.mode`` (:mod:`flows.placement`):
every mode the config accepts has a placement, local runs the stage flows in this process, deployments
dispatches them."""

from __future__ import annotations

from typing import get_args

import flows.dispatch
import flows.gpu
import flows.rl
from flows.placement import PLACEMENTS, gpu_stages
from verl_core.config import ExecutionConfig


def test_every_execution_mode_has_one_placement() -> None:
    modes = get_args(ExecutionConfig.model_fields["mode"].annotation)
    assert sorted(PLACEMENTS) == sorted(modes) == ["deployments", "local"]


def test_local_runs_the_stage_flows_and_deployments_dispatch_them() -> None:
    local = gpu_stages(ExecutionConfig(mode="local"))
    assert (local.sft, local.rl) == (flows.gpu.sft_flow, flows.rl.rl_loop)
    remote = gpu_stages(ExecutionConfig(mode="deployments"))
    assert remote == (flows.dispatch.remote_sft, flows.dispatch.remote_rl_loop, flows.dispatch.remote_export)
