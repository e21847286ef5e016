"""Typed results of the flows (what the CLI prints and the run's summary artifact shows).

The RL loop's :class:`~stages.floor.lineage.RLResult` lives in the floor, since the floor also rebuilds
it from the store after the loop ran as a deployment elsewhere; so does the eval's
:class:`~stages.floor.reports.EvalReport`, which the eval stage commits and flows read back."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from stages.floor.reports import EvalReport
from stages.floor.rescore import RescoreReport
from verl_core.runtime.run_length import StepCount


class StageURIs(BaseModel):
    """Manifest URIs of the pipeline's stages, in pipeline order; None: the stage did not run."""

    preprocess: str | None = None
    template_pack: str | None = None
    sft: str | None = Field(None, description="None with sft.enable=false")
    rl: str | None = Field(None, description="the RL loop's final checkpoint (ckpt/iter-XXXX)")
    export: str | None = Field(None, description="None with export.enable=false")
    eval: str | None = Field(None, description="None with export or eval disabled")
    gate: str | None = Field(
        None, description="the champion/challenger decision; None with gate.enable=false"
    )
    report: str | None = None

    def ran(self) -> dict[str, str]:
        """``{stage: manifest URI}`` of the stages that ran, in pipeline order."""
        return {name: uri for name, uri in self.model_dump().items() if uri is not None}


class GateOutcome(BaseModel):
    """The gate's decision on the run's export (the ``gate`` stage's summary)."""

    verdict: Literal["pass", "reject"]
    line: str = Field(description="the decision in one line: verdict, figures, failed guards")
    model: str | None = Field(
        None, description="models:/NAME/VERSION of the challenger (None: not registered)"
    )


class PipelineResult(BaseModel):
    """What :func:`flows.pipeline.rlhf_pipeline` returns (and logs to MLflow as ``pipeline_result.json``)."""

    run_id: str
    stages: StageURIs = Field(default_factory=StageURIs, description="manifest URI of each stage")
    val_accuracy: dict[int, float] = Field(
        default_factory=dict, description="RL iteration → held-out accuracy (greedy); 0: before RL"
    )
    timing_s: dict[str, float] = Field(
        default_factory=dict, description="stage (a StageURIs field) → wall seconds"
    )
    rl_timing_s: dict[str, float] = Field(
        default_factory=dict, description="RL phase (rollout, reward, update, validate) → seconds in the loop"
    )
    eval: EvalReport | None = Field(None, description="the eval stage's report (None: no eval ran)")
    gate: GateOutcome | None = Field(None, description="the gate's decision (None: gate.enable=false)")
    sft_steps: StepCount | None = Field(None, description="SFT optimizer steps, planned vs completed")
    rl_iterations: StepCount | None = Field(None, description="RL iterations, planned vs completed")
    data_snapshot: str | None = Field(None, description="the data snapshot directory the run read")


class RescoreResult(BaseModel):
    """What :func:`flows.rescore.rescore_flow` returns."""

    run_id: str
    name: str = Field(description="the rescore's name: its stages are rescore/{name}/...")
    reward_config_hash: str
    stages: dict[str, str] = Field(description="original stage → manifest URI of its rescore")
    report_uri: str = Field(description="manifest URI of rescore/{name}/report")
    report: RescoreReport
    wall_s: float = Field(description="seconds the whole rescore flow took (attach, score, compare)")
