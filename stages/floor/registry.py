"""The MLflow model registry as the record of which exported policy is in service.

Every export registers a version of one registered model (:func:`registered_name`). Two aliases say
which version serves and which one served before it:

    champion            the version in service (``models:/NAME@champion``)
    previous-champion   the champion it replaced; :func:`rollback` moves ``champion`` back to it

Each decision about a version (the gate's verdict, a promotion by hand, a rollback) is written as
tags of that version, ``verl_flow.decision.<key>`` (:func:`record_decision`): ``verdict``,
``reason``, ``p_value``, ``by`` (``gate``, ``hand`` or ``rollback``), ``time`` (UTC, ISO 8601) and
whatever else the decision carries. A new decision replaces the version's previous decision tags.

A promotion and a rollback both emit the Prefect event ``verl-flow.model.promoted`` (resource
``verl-flow.model.NAME``; payload ``name``, ``version``, ``previous``, ``by``, ``model_uri``): one
event for "the champion changed", whichever way, so one deployment trigger (serve-model) follows
both. The event goes to the configured Prefect API (``PREFECT_API_URL``); with none configured
(a local run on a temporary server) nothing is sent and the log says so.

:func:`start_from` makes a run start from the champion's export (``retrain.start_from``).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.floor.logging import stage_logger
from verl_core.config.run import MODEL_NAME_REFUSED
from verl_core.errors import VerlFlowError

if TYPE_CHECKING:
    from mlflow.entities.model_registry import ModelVersion
    from mlflow.tracking import MlflowClient

    from verl_core.config import VerlFlowConfig

CHAMPION = "champion"
PREVIOUS = "previous-champion"
DECISION_TAG = "verl_flow.decision."
ROLLED_BACK_TAG = "verl_flow.rolled_back"  # on a version a rollback demoted: when, and to which version
RUN_ID_TAG = "verl_flow.run_id"  # export lineage tag: the verl-flow run that produced the version
EXPORT_URI_TAG = "verl_flow.export_uri"  # export lineage tag: the export stage's manifest URI
PROMOTED_EVENT = "verl-flow.model.promoted"
MODELS_SCHEME = "models:/"


class RegistryError(VerlFlowError):
    """A registered model, version or alias is missing; the message names which, and where."""


@dataclass(frozen=True)
class ModelVersionRef:
    """One registered model version: ``name``/``version``, the MLflow run that logged it, its tags
    (export lineage, decision), its aliases and the artifact source it was registered from."""

    name: str
    version: str
    mlflow_run_id: str | None
    tags: dict[str, str]
    aliases: tuple[str, ...] = ()
    source: str = ""

    @property
    def uri(self) -> str:
        return f"{MODELS_SCHEME}{self.name}/{self.version}"

    @property
    def decision(self) -> dict[str, str]:
        """The version's last decision: ``verl_flow.decision.*`` tags without the prefix."""
        n = len(DECISION_TAG)
        return {k[n:]: v for k, v in sorted(self.tags.items()) if k.startswith(DECISION_TAG)}


def registered_name(cfg: VerlFlowConfig) -> str:
    """The registered model a run's exports are versions of: ``export.registered_model_name``, else
    ``{project}-{experiment}`` with each character MLflow refuses in a name as ``_`` (an experiment
    ``scale-0.5b-cpu``'s model is ``verl-flow-scale-0_5b-cpu``)."""
    t = cfg.trainer
    derived = "".join("_" if c in MODEL_NAME_REFUSED else c for c in f"{t.project_name}-{t.experiment_name}")
    return cfg.export.registered_model_name or derived


def _client(tracking_uri: str) -> MlflowClient:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def _missing(e: Exception) -> bool:
    return getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE")


def _ref(v: ModelVersion) -> ModelVersionRef:
    return ModelVersionRef(
        name=v.name,
        version=str(v.version),
        mlflow_run_id=v.run_id or None,
        tags=dict(v.tags or {}),
        aliases=tuple(getattr(v, "aliases", None) or ()),
        source=v.source or "",
    )


def _by_alias(client: MlflowClient, name: str, alias: str) -> ModelVersionRef | None:
    from mlflow.exceptions import MlflowException

    try:
        return _ref(client.get_model_version_by_alias(name, alias))
    except MlflowException as e:
        if _missing(e):
            return None
        raise


def _model_exists(client: MlflowClient, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException as e:
        if _missing(e):
            return False
        raise
    return True


def _version(client: MlflowClient, tracking_uri: str, name: str, version: str) -> ModelVersionRef:
    from mlflow.exceptions import MlflowException

    if not _model_exists(client, name):
        raise RegistryError(f"no registered model {name!r} in {tracking_uri}")
    try:
        return _ref(client.get_model_version(name, str(version)))
    except MlflowException as e:
        if not _missing(e):
            raise
    have = ", ".join(r.version for r in versions(tracking_uri, name)) or "none"
    raise RegistryError(
        f"registered model {name!r} has no version {version} (versions: {have}) in {tracking_uri}"
    )


def champion(tracking_uri: str, name: str) -> ModelVersionRef | None:
    """The version holding the ``champion`` alias; None when the model or the alias does not exist."""
    return _by_alias(_client(tracking_uri), name, CHAMPION)


def versions(tracking_uri: str, name: str) -> list[ModelVersionRef]:
    """Every version of ``name``, oldest first, with its aliases; [] when the model does not exist."""
    client = _client(tracking_uri)
    if not _model_exists(client, name):
        return []
    aliases: dict[str, list[str]] = {}
    for alias, version in (client.get_registered_model(name).aliases or {}).items():
        aliases.setdefault(str(version), []).append(alias)
    found = client.search_model_versions(filter_string=f"name = '{name}'")
    refs = [_ref(v) for v in found]
    refs = [
        ModelVersionRef(
            r.name, r.version, r.mlflow_run_id, r.tags, tuple(sorted(aliases.get(r.version, []))), r.source
        )
        for r in refs
    ]
    return sorted(refs, key=lambda r: int(r.version))


def model_names(tracking_uri: str) -> list[str]:
    """Registered models holding at least one verl-flow export (a version tagged with its run id)."""
    client = _client(tracking_uri)
    names = sorted(m.name for m in client.search_registered_models())
    return [n for n in names if any(RUN_ID_TAG in r.tags for r in versions(tracking_uri, n))]


def resolve(tracking_uri: str, uri: str) -> ModelVersionRef:
    """``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` → that version; a RegistryError naming the
    missing model, alias or version (and what exists) otherwise."""
    if not uri.startswith(MODELS_SCHEME):
        raise RegistryError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    rest = uri[len(MODELS_SCHEME) :].strip("/")
    name, at, alias = rest.partition("@")
    version = ""
    if not at:
        name, _, version = rest.rpartition("/")
    if not name or not (alias or version.isdigit()):
        raise RegistryError(f"{uri!r}: expected models:/NAME@ALIAS or models:/NAME/VERSION")
    client = _client(tracking_uri)
    if version:
        return _version(client, tracking_uri, name, version)
    if not _model_exists(client, name):
        raise RegistryError(f"no registered model {name!r} in {tracking_uri}")
    ref = _by_alias(client, name, alias)
    if ref is None:
        held = client.get_registered_model(name).aliases or {}
        have = ", ".join(f"{a}→{v}" for a, v in sorted(held.items())) or "none"
        raise RegistryError(
            f"registered model {name!r} has no alias {alias!r} (aliases: {have}) in {tracking_uri}"
        )
    return ref


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _tag_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def record_decision(tracking_uri: str, name: str, version: str, decision: dict[str, Any]) -> None:
    """Write ``decision`` as the version's ``verl_flow.decision.*`` tags (``time`` added when absent;
    dashes in keys become underscores, non-strings JSON), replacing its previous decision tags."""
    client = _client(tracking_uri)
    ref = _version(client, tracking_uri, name, version)
    tags = {
        f"{DECISION_TAG}{k.replace('-', '_')}": _tag_value(v) for k, v in decision.items() if v is not None
    }
    tags.setdefault(f"{DECISION_TAG}time", _now())
    for key in ref.tags:
        if key.startswith(DECISION_TAG) and key not in tags:
            client.delete_model_version_tag(name, ref.version, key)
    for key, value in sorted(tags.items()):
        client.set_model_version_tag(name, ref.version, key, value)


def promote(tracking_uri: str, name: str, version: str, *, decision: dict[str, Any], by: str) -> None:
    """Give ``version`` the ``champion`` alias (the old champion becomes ``previous-champion``), record
    ``decision`` with ``by`` (gate, hand) on it and emit ``verl-flow.model.promoted``. Promoting the
    champion itself records the decision and moves nothing."""
    log = stage_logger(__name__)
    client = _client(tracking_uri)
    ref = _version(client, tracking_uri, name, version)
    old = _by_alias(client, name, CHAMPION)
    record_decision(tracking_uri, name, ref.version, {**decision, "by": by})
    if old is not None and old.version == ref.version:
        log.info("registry: %s version %s is already the champion", name, ref.version)
        return
    client.set_registered_model_alias(name, CHAMPION, ref.version)
    if old is not None:
        client.set_registered_model_alias(name, PREVIOUS, old.version)
    previous = old.version if old is not None else None
    log.info("registry: %s version %s is the champion (previous: %s, by %s)", name, ref.version, previous, by)
    emit_promoted(name, ref.version, previous, by)


def rollback(tracking_uri: str, name: str) -> ModelVersionRef:
    """Move ``champion`` back to ``previous-champion`` (whose alias is then removed: a second rollback
    needs another promotion first); records a decision by=rollback on the restored version, tags the
    demoted one ``verl_flow.rolled_back`` and emits ``verl-flow.model.promoted`` (by=rollback).
    Returns the restored version."""
    log = stage_logger(__name__)
    client = _client(tracking_uri)
    if not _model_exists(client, name):
        raise RegistryError(f"no registered model {name!r} in {tracking_uri}")
    current = _by_alias(client, name, CHAMPION)
    prev = _by_alias(client, name, PREVIOUS)
    if current is None or prev is None:
        missing = CHAMPION if current is None else PREVIOUS
        raise RegistryError(f"cannot roll back {name!r}: it has no {missing!r} alias in {tracking_uri}")
    when = _now()
    decision = {"verdict": "pass", "reason": f"rollback from version {current.version}", "time": when}
    record_decision(tracking_uri, name, prev.version, {**decision, "by": "rollback"})
    client.set_model_version_tag(name, current.version, ROLLED_BACK_TAG, f"{when} to version {prev.version}")
    client.set_registered_model_alias(name, CHAMPION, prev.version)
    client.delete_registered_model_alias(name, PREVIOUS)
    log.info("registry: %s rolled back from version %s to %s", name, current.version, prev.version)
    emit_promoted(name, prev.version, current.version, "rollback")
    return _version(client, tracking_uri, name, prev.version)


def emit_promoted(name: str, version: str, previous: str | None, by: str) -> dict[str, Any] | None:
    """Emit ``verl-flow.model.promoted`` for ``name`` to the configured Prefect API and wait until it
    is sent (outside a flow run nothing else would flush it before the process exits); returns the
    event's resource and payload, None when no API is configured (logged)."""
    from launcher.prefect_api import configured_api

    log = stage_logger(__name__)
    resource = {"prefect.resource.id": f"verl-flow.model.{name}", "prefect.resource.name": name}
    payload = {
        "name": name,
        "version": version,
        "previous": previous or "",
        "by": by,
        "model_uri": f"{MODELS_SCHEME}{name}/{version}",
    }
    api = configured_api()
    if api is None:
        log.info(
            "registry: no Prefect API configured, no %s event sent for %s/%s", PROMOTED_EVENT, name, version
        )
        return None
    from prefect.context import FlowRunContext
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    if emit_event(PROMOTED_EVENT, resource=resource, payload=payload) is None:
        log.warning("registry: Prefect did not accept the %s event for %s/%s", PROMOTED_EVENT, name, version)
        return None
    if FlowRunContext.get() is None:  # a flow run's engine drains its events when it ends
        EventsWorker.drain_all(timeout=30.0, at_exit=False)
    log.info("registry: sent %s for %s/%s to %s", PROMOTED_EVENT, name, version, api.url)
    return {"resource": resource, "payload": payload}


# --------------------------------------------------------------------------------------------------
# retrain.start_from


def start_from(
    cfg: VerlFlowConfig, data_snapshot: str | None
) -> tuple[VerlFlowConfig, dict[str, Any] | None]:
    """The config a run starts with and its ``origin`` record for run.json (None: nothing to record,
    ``start_from=config`` without a data snapshot, so that run.json stays as it was).

    ``retrain.start_from=champion``: the champion's export (an HF model dir in the store, tokenizer
    and chat template included) becomes the initial model (``model.path``, ``model.init=pretrained``;
    the reference policy with it) and SFT is skipped (the champion holds the warm-up). A fork of the
    champion's checkpoint (``parent``) is not used: a fork continues its parent's iteration count,
    prompt cursor and optimizer state on the parent's data, while a nightly run trains the configured
    iterations on a new snapshot (and a scratch-tokenizer config trains a new vocabulary on it); the
    export needs none of that and is what the registry points at. Without a champion yet (the first
    night) the run starts from the config's model. What ``model.path`` becomes (a directory, or the
    export's store URI that each process fetches): :func:`champion_export`."""
    origin: dict[str, Any] = {"data_snapshot": data_snapshot} if data_snapshot else {}
    if cfg.retrain.start_from == "config":
        return cfg, ({"start_from": "config", **origin} if origin else None)
    from verl_core.config import with_overrides
    from verl_core.errors import ConfigError
    from verl_core.runtime.tracking import default_tracking_uri
    from verl_core.store import ArtifactStore

    t = cfg.tracking
    if not (t.enabled and "mlflow" in t.backends):
        raise ConfigError(
            "retrain.start_from=champion: needs MLflow's registry "
            "(tracking.enabled, 'mlflow' in tracking.backends)"
        )
    name = registered_name(cfg)
    ref = champion(t.uri or default_tracking_uri(cfg.store.url), name)
    if ref is None:
        stage_logger(__name__).info(
            "retrain.start_from=champion: %s has no champion yet, the config's model starts", name
        )
        return cfg, {"start_from": "config", "reason": f"no champion of {name} yet", **origin}
    store = ArtifactStore(
        cfg.store.url, max_attempts=cfg.store.max_attempts, outage_budget_s=cfg.store.outage_budget_s
    )
    export_uri, path = champion_export(store, ref, local_mode=cfg.execution.mode == "local")
    started = with_overrides(cfg, [f"model.path={path}", "model.init=pretrained", "sft.enable=false"])
    stage_logger(__name__).info("retrain.start_from=champion: %s (%s) starts the run", ref.uri, path)
    return started, {
        "start_from": "champion",
        "model_uri": ref.uri,
        "mlflow_run_id": ref.mlflow_run_id,
        "run_id": ref.tags.get(RUN_ID_TAG),
        "export_uri": export_uri,
        "model_path": path,  # a directory, or the export's URI (execution.mode=deployments, S3)
        **origin,
    }


def champion_export(store: Any, ref: ModelVersionRef, *, local_mode: bool = True) -> tuple[str, str]:
    """The export manifest URI of a registered version (its ``verl_flow.export_uri`` tag, else its
    run id and source stage tags) and what ``model.path`` becomes: the export's own directory in a
    local store; for another store (S3), in ``execution.mode=local`` (every stage in this process), a
    copy under :data:`~stages.floor.initial_model.CHAMPION_CACHE` named by the manifest's sha256
    (fetched once, beside then renamed); in ``execution.mode=deployments``, the manifest URI itself:
    the pipeline and each stage flow on the gpu pool fetch their own machine's copy at their entry
    (:func:`stages.floor.initial_model.fetch_initial_model`), and the config names the same model on
    every machine. The export must be readable now (an error naming it otherwise)."""
    from stages.floor.artifacts import MODEL_PREFIX
    from stages.floor.initial_model import cached_export
    from stages.floor.locations import export_stage

    uri = ref.tags.get(EXPORT_URI_TAG)
    if not uri:
        run, stage = ref.tags.get(RUN_ID_TAG), ref.tags.get("verl_flow.source_stage")
        if not run or not stage:
            raise RegistryError(
                f"{ref.uri}: no {EXPORT_URI_TAG} tag nor run id and source stage tags: not a verl-flow export"
            )
        uri = store.manifest_uri(run, export_stage(stage))
    manifest = store.read_manifest(uri)
    if store.url.startswith("file://"):
        config = store.file_uri(manifest, f"{MODEL_PREFIX}/config.json")
        return uri, str(Path(config.removeprefix("file://")).parent)
    if not local_mode:
        return uri, uri
    return uri, str(cached_export(store, uri))
