"""How a run knows that a rollout browser is open on its store: ``verl-flow browse`` writes a record
``browsers/{pid}.json`` (``url``, ``store``, ``run_ids``, ``pid``) under the user's state directory
(``$XDG_STATE_HOME/verl-flow``, default ``~/.local/state/verl-flow``) while it serves, and removes it
when it stops. A pipeline run's Prefect artifacts link to the browser page of the run when a live
record names its store (:func:`browser_url`). Nothing here imports Dash: the pipeline reads it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote


def records_dir() -> Path:
    """``$XDG_STATE_HOME/verl-flow/browsers`` (``~/.local/state/verl-flow/browsers`` by default)."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "verl-flow" / "browsers"


def write_record(url: str, store_url: str, run_ids: list[str]) -> Path:
    """Record this process's browser; returns the file (remove it with :func:`remove_record`)."""
    path = records_dir() / f"{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"url": url, "store": store_url, "run_ids": run_ids, "pid": os.getpid()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)
    return path


def remove_record(path: Path) -> None:
    path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def browser_url(store_url: str, run_id: str) -> str | None:
    """The page of ``run_id`` in a running browser over ``store_url`` (the store's normalised URL,
    :attr:`verl_core.store.ArtifactStore.url`), or None when no live browser shows it. A record whose
    process is gone (killed without cleaning up) is ignored."""
    folder = records_dir()
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if rec.get("store") != store_url or not _alive(int(rec.get("pid", 0))):
            continue
        if rec.get("run_ids") and run_id not in rec["run_ids"]:
            continue
        return f"{rec['url'].rstrip('/')}/run/{quote(run_id, safe='')}"
    return None
