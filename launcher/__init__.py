"""Process plumbing of verl-flow: SPMD jobs under torchrun (:mod:`launcher.spmd`), follower nodes
(:mod:`launcher.follow`), the run's log file and one-line failures (:mod:`launcher.run_log`), the
Prefect API check (:mod:`launcher.prefect_api`).

Rule: the launcher imports ``verl_core`` and Prefect, never ``flows`` nor ``stages``
(``tests/launcher/test_imports.py``). What an SPMD job runs on every rank is named by an import path
string in the job (``"flows.gpu:rl_rank"``), resolved on the worker side, so the flows that launch
jobs and the functions their ranks run sit above the launcher, not inside it.
"""
