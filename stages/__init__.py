"""Pipeline stages: one file per stage, each a Prefect task taking the run context, config and
artifact URIs and returning a manifest URI, plus the stage floor :mod:`stages.floor` (stage-location
names, config → verl_core builders, artifact readers/writers, the RL session, logging).

    snapshot       the newest dated data snapshot (returns the resolved ``data`` section)
    preprocess     raw rows → cleaned prompt and SFT tables
    template_pack  tokenizer and chat template
    sft            SFT warm-up
    rollout        generation of one iteration
    reward         scoring of one iteration's rollouts
    ppo_update     advantages and the policy (and critic) update
    validate       held-out accuracy of a policy version (returns the accuracy)
    export         merged HF model and its registry entry
    eval           the exported policy on held-out prompts
    gate           champion/challenger decision and promotion
    report         the run's metrics, plots and summary
    rescore        a run's rollouts scored again with other reward settings (one URI per stage)

What each takes, as it stands: ``snapshot``, ``preprocess``, ``template_pack``, ``sft``, ``rollout``,
``reward``, ``validate``, ``gate`` and ``rescore`` take config sections (or values unpacked from them),
``report`` none; ``ppo_update``, ``export`` and ``eval`` take the whole ``VerlFlowConfig`` (each reads
eight or nine sections; its docstring says which and why it keeps the whole config).

The RL stages (``rollout``, ``validate``, ``ppo_update``) work on the run's RL session
(:class:`stages.floor.session.RLSession`: models, engine, scorers, cursor, version): each task is a
shell that looks the session the RL loop bound up once and hands it to its body (``run_rollout``,
``run_validation``, ``run_update``), so Prefect sees only the run context, config and URIs.

Rule: a stage file imports verl_core and the floor, never another stage file; stages meet only
through artifacts (a stage that needs template_pack's outputs receives its manifest URI). Flows use
the stage tasks and the floor's public names only. ``tests/stages/test_imports.py`` holds the line.
"""
