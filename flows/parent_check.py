"""The check of a fork's or replay's parent, made once per run: the parent's checkpoint and a replay's
stored rollouts and rewards of every iteration it has still to train
(:func:`stages.floor.parent.check_parent`, which reads each of those manifests).

Every run passes the pipeline flow (``verl-flow run``, ``run --fork``, ``replay``, the Python API, a
deployment's flow run, a replay deployment's sub-flow), so the check is the pipeline's: it calls
:func:`check_once` before any work. A caller that has checked already, to refuse in one line before
any flow starts (the CLI), calls :func:`check_start` and hands the pipeline the :class:`ParentCheck`
it returns; the pipeline skips its own check when that record names the run, store and config it is
about to run, and checks again when it does not (a data snapshot or ``retrain.start_from`` changed
the config, and with it the default run id, after the caller checked).

Light on purpose (no Prefect, no torch): the CLI imports it before it quiets Prefect.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from stages.floor.parent import check_parent
from verl_core.config import VerlFlowConfig
from verl_core.store import ArtifactStore


class ParentCheck(BaseModel):
    """A passed check of ``config.parent`` for run ``run_id`` in the store ``store_url``, of the config
    with hash ``config_hash``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    store_url: str
    config_hash: str


def check_start(store: ArtifactStore, cfg: VerlFlowConfig, run_id: str) -> ParentCheck | None:
    """Check ``cfg``'s parent for run ``run_id`` (raises the one-line refusal) and return the record
    of it; None for a run without a parent (nothing to check)."""
    if cfg.parent is None:
        return None
    check_parent(store, cfg, run_id)
    return ParentCheck(run_id=run_id, store_url=store.url, config_hash=cfg.config_hash())


def check_once(store: ArtifactStore, cfg: VerlFlowConfig, run_id: str, checked: ParentCheck | None) -> None:
    """The pipeline's check: nothing when ``checked`` is a check of this config for this run in this
    store, else :func:`check_start`."""
    mine = ParentCheck(run_id=run_id, store_url=store.url, config_hash=cfg.config_hash())
    if cfg.parent is not None and checked != mine:
        check_start(store, cfg, run_id)
