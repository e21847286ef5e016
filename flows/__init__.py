"""Prefect flows: the rlhf pipeline, the RL loop, the GPU stage flows, the CLI.

Rule: a flow only orchestrates. It calls stage tasks and the stage floor's public names
(:mod:`stages.floor`), passes config sections and manifest URIs, and returns typed results
(:class:`flows.results.PipelineResult`, :class:`stages.floor.state.RLResult`); it never builds or
parses stage names, nor imports a stage's private helpers. Every flow names its config parameter
``config``.
"""

from flows.quiet import quiet_library_warnings

quiet_library_warnings()  # DeepSpeed's and bitsandbytes' CPU warnings, in every flow run (flows.quiet)
