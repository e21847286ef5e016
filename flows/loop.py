"""What the calls of one RL loop share, built once per loop (:func:`flows.rl.rl_iterations`): the run,
its config, the tokenized prompts, the policy lineage and planned iterations, the phase timings and the
stage callables, Prefect tasks or their plain functions (chosen in one place,
:func:`flows.rl.loop_stages`). No models: the ahead rollout's Prefect task takes a :class:`Loop` as a
parameter, so the RL session (:class:`stages.floor.session.RLSession`) is not here; the loop hands it
to the helpers that need it as a parameter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from verl_core.config import VerlFlowConfig
from verl_core.runtime.run import RunContext


@dataclass(frozen=True)
class LoopStages:
    """The RL loop's stages as it calls them: tasks (a flow run's task runs) or their ``.fn`` (no
    Prefect task runs: the benchmarks' baseline, the other ranks of an SPMD job). ``ahead`` submits
    the ahead rollout (``trainer.rollout_ahead=1``) to a worker thread and returns its future."""

    init: Callable[..., int]
    rollout: Callable[..., str]
    reward: Callable[..., str]
    update: Callable[..., str]
    validate: Callable[..., float]
    checkpoint: Callable[..., str]
    ahead: Callable[..., Any]


@dataclass(frozen=True)
class Loop:
    """One RL loop's context; ``timings`` (seconds per phase: rollout, reward, update, validate,
    weight_sync) is added to by every timed call."""

    ctx: RunContext
    config: VerlFlowConfig
    template_pack_uri: str
    lineage: str
    iterations: int  # the RL iterations the run plans (the session's)
    timings: dict[str, float]
    stages: LoopStages
