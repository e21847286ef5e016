"""The stage floor: what every stage stands on, and the only part of ``stages/`` flows may reach into
besides the stage tasks themselves.

    locations   stage names of a run (``iter-XXXX/rollout``, ``ckpt/iter-XXXX``, ``export/...``),
                built and parsed in one place
    policy      the policy and its reference from ``model``/``ref`` (scratch or pretrained, LoRA, QLoRA),
                an actor/critic/ref section's mixed precision
    scorers     reward scorers by name from ``reward``/``sandbox``, the one scoring call (reward
                stage, validation, eval, benchmarks)
    engines     the rollout engine from ``rollout``: each engine's keyword arguments (keyed by verl_core's
                engine registry entries), ``auto`` resolved, this rank's engine under torchrun
    rollouts    an iteration's sampling parameters, one engine's rollouts (multi-turn with tools), the
                rollouts of every engine of an SPMD job
    specs       the RL loop's plan and updates: iterations planned, optimizer specs, PPO spec, update seed
    artifacts   readers/writers of artifacts more than one stage uses (policies, tokenizer, exports
                and their copies, what an eval evaluates, the rollouts table)
    reports     what eval and report commit, read back for flows: the typed eval report and its
                samples, per-iteration metric series and their markdown table
    samples     per-sample tables (train/val rollouts) for the tracker, Prefect table artifacts
    session     the RL session: the models, engine, scorers, cursor and version one RL loop works on,
                the functions that change it, and how the loop binds it for its task shells
    opening     opening a session: the start point (own checkpoint, fork, SFT, initial model), the
                reference, the engines
    checkpoint  the session's checkpoints and the update manifests they publish, the resume iteration
    lineage     a run's policy lineage, the RL loop's result and that result rebuilt from the store
    commit      the SPMD stage pattern (main rank decides the skip and commits, every rank computes)
    heldout     the held-out passes validation and eval share (greedy and sampled, scored, pass@k)
    logging     stage loggers, progress bars, the ``timed`` context manager
    environment what a config needs of the environment (packages, CUDA): the fast check the GPU
                stage flows run at start, and ``verl-flow doctor``'s checks
    rescore     ``verl-flow rescore``: which settings may change, the plan (name, reward config hash,
                stages to score again), its lease, its report read back
    retry       which task failures Prefect retries (not config errors nor deterministic scorer errors)
    parent      forks and replays: runs that start from another run's checkpoint, and their checks
    registry    the MLflow model registry: registered names, the champion and previous aliases
    champion    the registry's champion as the gate sees it: its export, its reusable eval, the pairs
    model_card  an export's ``model/README.md`` (Hugging Face model-card layout)
    fingerprint a run's committed artifacts by digest, per-process values left out (determinism checks)
    initial_model  the run's initial model on this machine's disk when ``model.path`` is an export's
                store URI

Rule: a floor module imports verl_core and other floor modules, never a stage file.
"""
