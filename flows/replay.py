"""The replay flow (``verl-flow replay``, deployment ``replay/replay`` on the cpu pool): a new run that
starts from run R's checkpoint at iteration I and trains iterations I.. on R's stored rollouts and
rewards (or a rescore's rewards) with other update settings. It only orchestrates:

    parent config + overrides (checked) ─► rlhf-pipeline (parent.replay: the parent's data checked)

``verl-flow replay`` builds the config and checks the parent before any flow starts, and hands both
over in this process (:func:`flows.parent_check.handed_over`): the flow uses that config when it is
the replay the flow is asked for (the same run, from-iteration, overrides, rewards and store), and the
pipeline skips its check when it names the same run, store and config. Otherwise (a deployment, a
retried flow run, Python) the flow builds the config itself and the pipeline checks the parent
(:mod:`flows.parent_check`). The pipeline does the rest as for any run with a ``parent``
(:mod:`stages.floor.parent`): preprocess and template_pack of its own, no SFT, the RL loop from R's
checkpoint, validation, export, eval; ``deployments`` mode sends the RL loop to the gpu pool as usual.
Rerun with the same arguments, the replay resumes (same run id, committed stages skip).
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from flows.parent_check import built_replay
from flows.pipeline import rlhf_pipeline
from flows.results import PipelineResult
from stages.floor.parent import replay_config, replay_run_id
from verl_core.config import StoreConfig
from verl_core.store import ArtifactStore


@flow(name="replay", log_prints=True, validate_parameters=True)
def replay_flow(
    run_id: str,
    start_iteration: int,
    overrides: list[str] | None = None,
    new_run_id: str | None = None,
    rewards: str | None = None,
    store_url: str | None = None,
) -> PipelineResult:
    """Replay run ``run_id`` (store ``store_url``, default ./runs) from its checkpoint at
    ``start_iteration`` with ``overrides`` (``algorithm.*``, ``actor.*``, ``critic.*`` ...), on its
    rewards or those of its rescore ``rewards``, as run ``new_run_id`` (default
    ``{run_id}-replay{I}-{config hash[:8]}``).

    Args:
        run_id: The run to replay, as its store names it (``runs/<run_id>``).
        start_iteration: The iteration whose checkpoint the replay starts from.
        overrides: Dotted settings changed for the replay, e.g. ``algorithm.kl_ctrl.kl_coef=0.01``.
        new_run_id: The replay's run id (empty: ``{run_id}-replay{I}-{config hash[:8]}``).
        rewards: A rescore's name whose rewards the replay trains on (empty: the run's own rewards).
        store_url: The store holding the run (empty: the worker's ``./runs``).
    """
    store = ArtifactStore(store_url or StoreConfig().url)
    asked = (run_id, start_iteration, overrides or [], rewards, store.url)
    cfg = built_replay(*asked) or replay_config(store, run_id, start_iteration, overrides or [], rewards)
    new_run_id = new_run_id or replay_run_id(run_id, start_iteration, cfg.config_hash())
    get_run_logger().info(
        "replay of run %s from iteration %d as run %s (%s rewards, overrides: %s)",
        run_id, start_iteration, new_run_id, rewards or "its own", " ".join(overrides or []) or "none",
    )  # fmt: skip
    return rlhf_pipeline(config=cfg, run_id=new_run_id)  # it checks the parent unless handed the check
