"""Process-level modules: what a run needs around the kernels, not the kernels themselves.

run             the run context handed to every stage (store URL, run id, tracking ids)
run_length      planned vs completed steps: a short run is an error, never a quiet success
ranks           who does what in an SPMD job (main rank decides, commits, reports)
launch          the torchrun command of an SPMD job and what a follower learns of it
watchdog        the hang watchdog of a stage
tracking        MLflow tracking (and W&B through ``wandb_tracking``)
sandbox         untrusted code under bubblewrap (the code scorer, the python tool)
serving         vLLM's OpenAI-compatible server on an exported model
env             process environment for quiet, offline, server-less runs
doctor          environment checks (``verl-flow doctor``), ``reachability`` its network part
"""
