"""verl_core: the kernels and libraries of verl-flow (data, models, rollout engines, reward scoring,
RL algorithms, training engines, the artifact store), and in ``runtime`` what runs around them (run
context, ranks, launch, watchdog, tracking, sandbox, serving, doctor). No Prefect.

Top level: the kernels' packages and a few leaf utilities (errors, registry, seeding, files, timing,
version).

Rule: verl_core functions take tensors and plain values and return tensors or named results; they
never take the config object (the stages unpack it), and verl_core never imports ``stages`` or
``flows``.
"""
