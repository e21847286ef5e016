"""What runs where: one record per served model name, for ``verl-flow serve status|stop`` and the
``serve-model`` deployment's replacement of a running server.

Layout under the state directory (``$VERL_FLOW_SERVE_DIR``, else ``~/.verl-flow/serve``)::

    <name>/record.json       the running server: pid (= its process group), host, port, url, served
                             names, version, weights digest, started, log (written once it is ready)
    <name>/server.log        its output (kept after it stops, overwritten by the next start)
    <name>/sha256-<digest>   a link to the model directory: the path given to vLLM, so /v1/models
                             reports the weights' digest as the model's ``root``
    cache/<manifest sha256>  exports of a remote store, written out once and reused by later serves
                             (delete the directory to reclaim the space)

``<name>`` is the name quoted for a file name (``models:/m@champion`` serves name ``m``).
A record whose process group is gone, or whose pid now belongs to something that is not a vLLM
server (a reused pid), is stale: :func:`read_records` reports it and :func:`remove_record` deletes it
with its link. :func:`stop_record` stops a server by its record (SIGTERM to the group, then
SIGKILL), from any process.
"""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from verl_core.runtime.serving import group_alive, stop_group

STATE_ENV = "VERL_FLOW_SERVE_DIR"
RECORD = "record.json"
LOG = "server.log"
LINK_PREFIX = "sha256-"


class ServeRecord(BaseModel):
    """A server started by ``verl-flow serve`` or the ``serve-model`` deployment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # the registered model name, the run id, or the directory's name
    target: str  # what was asked for (models:/..., a run id, a directory)
    pid: int  # the server's pid and process group id (its own session)
    host: str
    port: int
    url: str  # http://host:port (the OpenAI base URL is url + /v1)
    names: list[str]  # served model names, the one responses carry first
    version: str | None  # the registered model version (None: a run id or a directory)
    digest: str  # sha256 of the weights (:func:`verl_core.runtime.serving.weights_digest`)
    model_dir: str  # the model directory (in the store for a local store, else the cache)
    root: str  # the path vLLM was given (its /v1/models ``root``): the sha256-<digest> link
    log: str
    started: str  # ISO 8601, UTC
    owner_pid: int  # the process that started it (a foreground serve, a flow run)
    detached: bool


def state_dir() -> Path:
    """The state directory: ``$VERL_FLOW_SERVE_DIR``, else ``~/.verl-flow/serve``."""
    return Path(os.environ.get(STATE_ENV) or Path.home() / ".verl-flow" / "serve").expanduser()


def record_dir(name: str) -> Path:
    return state_dir() / urllib.parse.quote(name, safe="")


def cache_dir() -> Path:
    return state_dir() / "cache"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def link_weights(name: str, model_dir: str | Path, digest: str) -> Path:
    """``<name>/sha256-<digest>`` → ``model_dir`` (replacing any link of an earlier server)."""
    directory = record_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_links(directory)
    link = directory / f"{LINK_PREFIX}{digest}"
    link.symlink_to(Path(model_dir).resolve(), target_is_directory=True)
    return link


def _remove_links(directory: Path) -> None:
    for old in directory.glob(f"{LINK_PREFIX}*"):
        if old.is_symlink():
            old.unlink(missing_ok=True)


def write_record(record: ServeRecord) -> Path:
    """Write ``record`` atomically (a reader sees the old one or the new one)."""
    path = record_dir(record.name) / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{RECORD}.{os.getpid()}")
    part.write_text(record.model_dump_json(indent=2))
    os.replace(part, path)
    return path


def read_record(name: str) -> ServeRecord | None:
    path = record_dir(name) / RECORD
    try:
        return ServeRecord.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # half-written by a killed writer of an older version: treat as stale
        return None


def read_records(name: str | None = None) -> list[tuple[ServeRecord, bool]]:
    """``(record, alive)`` of ``name``'s server, or of every server (sorted by name)."""
    names = [name] if name is not None else _names()
    out = []
    for n in names:
        record = read_record(n)
        if record is not None:
            out.append((record, is_alive(record)))
    return out


def _names() -> list[str]:
    base = state_dir()
    if not base.is_dir():
        return []
    return sorted(urllib.parse.unquote(d.name) for d in base.iterdir() if (d / RECORD).is_file())


def is_alive(record: ServeRecord) -> bool:
    """Its process group has a process left, and its pid is still a vLLM server (not a reused pid)."""
    if not group_alive(record.pid):
        return False
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes()
    except OSError:  # no procfs (macOS), or the leader is gone and its workers are left: ours
        return True
    return b"vllm" in cmdline or not cmdline  # a zombie leader has an empty cmdline


def remove_record(name: str, pid: int | None = None) -> None:
    """Delete ``name``'s record and weights link (the log stays); with ``pid``, only when the record
    is that server's (a replacement's record is left alone)."""
    if pid is not None and getattr(read_record(name), "pid", None) != pid:
        return  # not that server's record (any more): a replacement may be starting on the link
    directory = record_dir(name)
    with contextlib.suppress(FileNotFoundError):
        (directory / RECORD).unlink()
    if directory.is_dir():
        _remove_links(directory)


def stop_record(record: ServeRecord, timeout_s: float = 30.0) -> None:
    """Delete the record, then stop its server (when it is still that server): the process waiting
    on the server (a foreground serve, a flow run) sees it gone when the server exits, i.e. stopped
    on purpose (a replacement, ``serve stop``), not crashed."""
    alive = is_alive(record)
    remove_record(record.name, record.pid)
    if alive:
        stop_group(record.pid, timeout_s)
