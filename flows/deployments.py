"""What prefect.yaml's deployments compute when ``prefect deploy`` runs, and what the pipeline flow does
with the parameters of a Run form.

Deploy time, build steps of prefect.yaml (each returns the outputs its ``{{ ID.KEY }}`` placeholders
read):

- :func:`team_settings`: whether the environment variables a team deployment needs (the shared store,
  MLflow, the data snapshots) are set. A deployment missing one gets its description opening with
  what to set, its schedule inactive and its automation disabled, so that ``prefect deploy --all`` on
  one machine leaves nothing that fires on its own and fails (the pipeline's flow refuses the empty
  store and MLflow of ``deployments`` mode in one line; rescore, replay and serving use ./runs).
  prefect.yaml's ``paused`` is a plain bool, not templated from step outputs; schedules' ``active``
  and triggers' ``enabled`` are.
- :func:`form_config`: the deployment's config file with its overrides, resolved: the deployment's
  ``config`` parameter, which the UI's Run form shows as its values.

Run time, :func:`form_overrides`: the fields of a submitted ``config`` that differ from the
deployment's own ``config`` parameter (what the form showed) are the user's edits, applied on top of
the config file as dotted overrides would be; the flow run's parameters then record those overrides
instead of the whole config (:func:`record_overrides`).
"""

from __future__ import annotations

import json
import os
from typing import Any
from uuid import UUID

from pydantic import ValidationError

from verl_core.config import VerlFlowConfig, load_config, with_overrides
from verl_core.errors import ConfigError


def team_settings(names: list[str], local: bool = False) -> dict[str, Any]:
    """Build step: ``enabled`` (every variable of ``names`` is set: the deployment's schedule and
    automation may fire) and ``note`` (the description's first sentence when one is unset, else '').
    ``local``: the flow falls back to the worker's ./runs (an empty ``store_url``), where the
    quickstart's runs are, and works on one machine."""
    missing = ", ".join(n for n in names if not os.environ.get(n))
    note = ""
    if missing and local:
        note = f"LOCAL STORE: {missing} unset at deploy time, so the worker's ./runs; automation off. "
    elif missing:
        note = f"NOT CONFIGURED: {missing} unset at deploy time, schedule and automation off. "
    if missing:
        note += "Set and run `prefect deploy --all` again. "
    return {"enabled": not missing, "note": note}


def form_config(config_file: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """Build step: ``config``, the resolved ``config_file`` + ``overrides`` as JSON (the Run form's
    values). Overrides that do not validate (a team deployment's empty placeholders: its description
    says NOT CONFIGURED, :func:`team_settings`) leave the file's own values."""
    try:
        cfg = load_config(config_file, overrides or [])
    except ConfigError:
        cfg = load_config(config_file)
    return {"config": cfg.model_dump(mode="json")}


def _leaf_overrides(new: Any, old: Any, key: str) -> list[str]:
    """``key=value`` for every leaf where ``new`` differs from ``old`` (nested dicts compared key by
    key when both have the same keys; anything else replaced whole, its value as JSON, which the
    override parser reads as YAML; strings as they are)."""
    if new == old:
        return []
    if isinstance(new, dict) and isinstance(old, dict) and new.keys() == old.keys():
        return [o for k in new for o in _leaf_overrides(new[k], old[k], f"{key}.{k}" if key else k)]
    return [f"{key}={new if isinstance(new, str) else json.dumps(new)}"]


def form_overrides(submitted: VerlFlowConfig, shown: VerlFlowConfig) -> list[str]:
    """The dotted overrides that turn ``shown`` (the form's values) into ``submitted`` (what the form
    sent); raises :class:`ConfigError` if they would not give ``submitted`` back exactly."""
    new, old = submitted.model_dump(mode="json"), shown.model_dump(mode="json")
    changes = _leaf_overrides(new, old, "")
    if with_overrides(shown, changes).model_dump(mode="json") != new:
        raise ConfigError(f"config: the Run form's changes {changes} do not round-trip as overrides")
    return changes


def deployment_config() -> VerlFlowConfig | None:
    """The ``config`` parameter of the deployment this flow run comes from (what its Run form
    showed); None outside a deployment or for a deployment without one."""
    from prefect import get_client
    from prefect.runtime import deployment

    if deployment.id is None:
        return None
    with get_client(sync_client=True) as client:
        raw = (client.read_deployment(deployment.id).parameters or {}).get("config")
    if raw is None:
        return None
    try:
        return VerlFlowConfig.model_validate(raw)
    except ValidationError as e:
        what = f"deployment {deployment.name}: its config parameter no longer validates"
        raise ConfigError(f"{what}; deploy it again: {e}") from None


def record_overrides(overrides: list[str]) -> None:
    """Replace this flow run's recorded ``config`` parameter by ``overrides`` (what it amounted to)."""
    from prefect import get_client
    from prefect.runtime import flow_run

    run_id = UUID(str(flow_run.id))
    with get_client(sync_client=True) as client:
        params = dict(client.read_flow_run(run_id).parameters or {})
        params.pop("config", None)
        client.update_flow_run(run_id, parameters={**params, "overrides": overrides})
