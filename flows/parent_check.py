"""The check of a fork's or replay's parent, made once per run: the parent's checkpoint and a replay's
stored rollouts and rewards of every iteration it has still to train
(:func:`stages.floor.parent.check_parent`, which reads each of those manifests).

Every run passes the pipeline flow (``verl-flow run``, ``run --fork``, ``replay``, the Python API, a
deployment's flow run, a replay deployment's sub-flow), so the check is the pipeline's: it calls
:func:`check_once` before any work. A caller that has checked already, to refuse in one line before
any flow starts (the CLI), calls :func:`check_start` and runs the flow inside :func:`handed_over`
with the :class:`ParentCheck` it returned (and ``verl-flow replay`` with the replay config it built,
:class:`BuiltReplay`). The pipeline skips its own check when that record names the run, store and
config it is about to run, and checks again when it does not (a data snapshot or
``retrain.start_from`` changed the config, and with it the default run id, after the caller checked).

The records are handed over in this process (a context variable), never as flow parameters: a
deployment's Run form cannot fill them in, and Prefect's "Retry" of a flow run (a new process, the
saved parameters) checks again, whatever happened to the parent's checkpoints since.

Light on purpose (no Prefect, no torch): the CLI imports it before it quiets Prefect.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple

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


@dataclass(frozen=True)
class BuiltReplay:
    """The config of a replay of run ``run_id`` from ``start_iteration`` with ``overrides`` on the
    rewards ``rewards`` (None: its own) in the store ``store_url``, as
    :func:`stages.floor.parent.replay_config` built and checked it."""

    run_id: str
    start_iteration: int
    overrides: tuple[str, ...]
    rewards: str | None
    store_url: str
    config: VerlFlowConfig


class _Handover(NamedTuple):
    check: ParentCheck | None
    replay: BuiltReplay | None


_HANDED: ContextVar[_Handover | None] = ContextVar("verl_flow_parent_handover", default=None)


@contextmanager
def handed_over(check: ParentCheck | None, replay: BuiltReplay | None = None) -> Iterator[None]:
    """Within the block (this thread, and contexts copied from it) the flows find ``check`` and
    ``replay``: what the caller checked and built before starting them."""
    token = _HANDED.set(_Handover(check, replay))
    try:
        yield
    finally:
        _HANDED.reset(token)


def check_start(store: ArtifactStore, cfg: VerlFlowConfig, run_id: str) -> ParentCheck | None:
    """Check ``cfg``'s parent for run ``run_id`` (raises the one-line refusal) and return the record
    of it; None for a run without a parent (nothing to check)."""
    if cfg.parent is None:
        return None
    check_parent(store, cfg, run_id)
    return ParentCheck(run_id=run_id, store_url=store.url, config_hash=cfg.config_hash())


def check_once(store: ArtifactStore, cfg: VerlFlowConfig, run_id: str) -> None:
    """The pipeline's check: nothing when the handed-over check is one of this config for this run in
    this store, else :func:`check_start`."""
    mine = ParentCheck(run_id=run_id, store_url=store.url, config_hash=cfg.config_hash())
    handed = _HANDED.get()
    if cfg.parent is not None and (handed is None or handed.check != mine):
        check_start(store, cfg, run_id)


def built_replay(
    run_id: str, start_iteration: int, overrides: Sequence[str], rewards: str | None, store_url: str
) -> VerlFlowConfig | None:
    """The handed-over replay config when it is the replay asked for (the same parent run,
    from-iteration, overrides, rewards and store), else None (the caller builds it)."""
    handed = _HANDED.get()
    built = handed.replay if handed is not None else None
    if built is None or built != BuiltReplay(
        run_id, start_iteration, tuple(overrides), rewards, store_url, built.config
    ):
        return None
    return built.config
