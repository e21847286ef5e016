"""Typed results of the flows (what the CLI prints and the run's summary artifact shows).

The RL loop's :class:`~stages.floor.state.RLResult` lives in the floor, since the floor also rebuilds
it from the store after the loop ran as a deployment elsewhere."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class PipelineResult(BaseModel):
    """What :func:`flows.pipeline.rlhf_pipeline` returns (and logs to MLflow as ``pipeline_result.json``)."""

    run_id: str
    stages: dict[str, str] = Field(default_factory=dict, description="stage → its manifest URI")
    val_accuracy: dict[int, float] = Field(
        default_factory=dict, description="RL iteration → held-out accuracy (greedy); 0: before RL"
    )
    timing_s: dict[str, float] = Field(
        default_factory=dict, description="stage → wall seconds; rl/{phase} → seconds inside the RL loop"
    )
    eval: dict[str, Any] = Field(default_factory=dict, description="the eval stage's report")
    data_snapshot: str | None = Field(None, description="the data snapshot directory the run read")
