"""Prefect flows: the rlhf pipeline, the RL loop, the GPU stage flows, the CLI.

    pipeline     the rlhf pipeline flow: the stages in order, local or through deployments
    placement    where the GPU-heavy stages run (this process or deployments), chosen once per run
    parent_check the check of a fork's or replay's parent, made once per run
    rl, loop     the RL iteration loop, and what its calls share (built once per loop)
    sampling     DAPO dynamic sampling of one RL iteration
    gpu          the GPU-heavy stage flows (SFT, the RL loop) deployed on the gpu pool
    dispatch     a stage flow run as a deployment on another pool, waited for
    heartbeat    a dispatched stage flow run's side: its stage lease held (the store's lease protocol)
    deployments  what prefect.yaml's deployments compute, and a Run form's parameters
    progress     the stage flows' progress lines in the pipeline flow run's log
    gating       the gate step: the champion's eval reused or run again, the decision
    replay       the replay flow: a run from another run's checkpoint on its stored rollouts
    rescore      the rescore flow: stored rollouts scored again with other reward settings
    serving      ``verl-flow serve`` and the serve-model deployment
    runs         starting a run from its config (lease, run.json, tracker runs), attaching to an existing one
    run_links    where a run is tracked (its Prefect flow run, its MLflow run), recorded in its store
    results      typed results of the flows
    prefect_artifacts  the Prefect UI artifacts of a run (summary markdown, eval samples table); the
                 run's own artifacts are store files (:mod:`verl_core.store`)
    quiet        library warnings dropped where they are logged
    cli          the ``verl-flow`` command, one module per command group

Rule: a flow only orchestrates. It calls stage tasks and the stage floor's public names
(:mod:`stages.floor`), passes config sections (the whole config to the stages that take it, see
:mod:`stages`) and manifest URIs, and returns typed results
(:class:`flows.results.PipelineResult`, :class:`stages.floor.lineage.RLResult`); it never builds or
parses stage names, nor imports a stage's private helpers. Every flow names its config parameter
``config``.
"""

from flows.quiet import quiet_library_warnings

quiet_library_warnings()  # DeepSpeed's and bitsandbytes' CPU warnings, in every flow run (flows.quiet)
