"""verl_core: the kernels and libraries of verl-flow (data, models, rollout engines, reward scoring,
RL algorithms, training engines, the artifact store, tracking). No Prefect.

Rule: verl_core functions take tensors and plain values and return tensors or named results; they
never take the config object (the stages unpack it), and verl_core never imports ``stages`` or
``flows``.
"""
