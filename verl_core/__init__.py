"""verl_core: the kernels and libraries of verl-flow, and what runs around them. No Prefect.

    algorithms  advantages, policy/value losses, KL, loss aggregation (pure torch)
    data        dataset adapters and cleaning, chat templates, tokenizers, packing, sampling
    models      loading (HF, from scratch, LoRA/QLoRA), packed forward, value heads, checkpoint files
    rollout     generation engines behind one protocol (HF, vLLM), multi-turn
    reward      reward scoring (rules, functions, a reward model, HTTP scorers)
    tools       what a model can call in a multi-turn rollout
    training    optimizer engines (single device, FSDP2, DeepSpeed), SFT and PPO losses
    store       the artifact store: fsspec URLs, Parquet schemas, manifest commits
    config      the one typed configuration (schema, loader, cross-field checks)
    planning    a run's memory and time plan, from its config before it starts
    runtime     around the kernels: run context, ranks, launch, watchdog, tracking, sandbox, serving,
                doctor

Top level: those packages and a few leaf utilities (errors, registry, seeding, files, timing,
version).

Rule: the kernels (algorithms, data, models, rollout, reward, tools, training, store) take tensors and
plain values and return tensors or named results; they never take the config object (the stages
unpack it). Not so, today: ``planning`` reads the whole config (a plan is of a run). A run is
started from its config above verl_core (``flows.runs.start_run``); ``runtime.run`` holds the run
context and values only. verl_core never imports ``stages`` or ``flows``.
"""
