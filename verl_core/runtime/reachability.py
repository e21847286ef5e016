"""Reachability checks of ``verl-flow doctor --config``: the artifact store and MLflow's tracking URI,
each answered within a short timeout (a daemon thread guards calls that could hang), as
:class:`~verl_core.runtime.doctor.Check` rows. Nothing is created: a local root is probed with a temporary
file that is removed, or through its nearest existing parent."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_core.runtime.doctor import Check


def _within(timeout_s: float, fn: Callable[[], Check], name: str, what: str, fix: str) -> Check:
    """``fn()`` in a daemon thread, an error Check when it has not answered after ``timeout_s``."""
    box: list[Check] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=target, daemon=True, name=f"doctor-{name}")
    thread.start()
    thread.join(timeout_s)
    if box:
        return box[0]
    if failure:
        e = failure[0]
        return Check(name, "error", f"{what}: {type(e).__name__}: {e}".splitlines()[0][:300], "", fix)
    return Check(name, "error", f"{what}: no answer within {timeout_s:g} s", "", fix)


def _writable_dir(path: Path) -> tuple[bool, Path]:
    """Whether files can be created at ``path`` (the directory itself, or its nearest existing parent
    when it does not exist yet); returns the directory actually tested. Creates nothing that stays."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return False, probe
    if probe != path:
        return os.access(probe, os.W_OK | os.X_OK), probe
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".verl-flow-doctor-"):
            pass
    except OSError:
        return False, probe
    return True, probe


def _redacted(check: Check) -> Check:
    """``check`` without ``user:password@`` in the URLs it quotes."""
    from verl_core.config.loader import redact_url

    return check._replace(found=redact_url(check.found), fix=redact_url(check.fix))


def store_check(url: str, *, timeout_s: float = 5.0) -> Check:
    """The artifact store at ``url`` reachable: a local root writable, ``s3://`` listable with the
    endpoint and credentials of the environment (one attempt, ``timeout_s`` in all)."""
    return _redacted(_store_check(url, timeout_s))


def _store_check(url: str, timeout_s: float) -> Check:
    from verl_core.store.store import normalize_url

    url = normalize_url(url)
    if url.startswith("memory://"):
        return Check("store", "ok", f"{url} (in-process)")
    if url.startswith("file://"):
        ok, probe = _writable_dir(Path(url[len("file://") :]))
        if ok:
            return Check("store", "ok", f"{url} writable")
        fix = "store.url: a directory you can write to (or fix its permissions)"
        return Check("store", "error", f"{url}: {probe} is not a writable directory", "writable", fix)
    if url.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
        fix = (
            f"check that the S3 endpoint ({endpoint}, from AWS_ENDPOINT_URL_S3) is up and that "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY are exported"
        )
        fs, bucket = _s3_filesystem(url, timeout_s)  # imports and set-up, no request yet
        # botocore's connect and read timeouts apply one after the other: guard the pair
        return _within(2 * timeout_s + 1, lambda: _s3_list(fs, bucket, url, fix), "store", url, fix)
    return Check("store", "warn", f"{url}: not checked (scheme not known to the doctor)")


def _s3_filesystem(url: str, timeout_s: float) -> tuple[Any, str]:
    """A private s3fs filesystem for ``url`` (the store's options: endpoint from the environment),
    one attempt with ``timeout_s`` connect and read timeouts; and the bucket name."""
    import fsspec

    from verl_core.store.store import storage_options

    opts = storage_options(url, max_attempts=1)
    opts["config_kwargs"].update({"connect_timeout": timeout_s, "read_timeout": timeout_s})
    opts["skip_instance_cache"] = True
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.retries = 1  # s3fs's own retry loop on connection errors (5 with backoff by default)
    return fs, root.split("/", 1)[0]


def _s3_list(fs: Any, bucket: str, url: str, fix: str) -> Check:
    try:
        fs.ls(bucket)
    except FileNotFoundError:
        fix = f"create the bucket (aws s3 mb s3://{bucket}), or store.url: another bucket"
        return Check("store", "error", f"{url}: bucket {bucket!r} does not exist", "", fix)
    except PermissionError as e:
        return Check("store", "error", f"{url}: access denied ({e})"[:300], "list permission", fix)
    except Exception as e:
        if "credentials" in f"{type(e).__name__} {e}".lower():
            fix = (
                "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL_S3 for a "
                "non-AWS endpoint)"
            )
            return Check("store", "error", f"{url}: no S3 credentials found", "", fix)
        raise
    return Check("store", "ok", f"{url} reachable")


def tracking_check(uri: str | None, store_url: str, *, enabled: bool = True, timeout_s: float = 5.0) -> Check:
    """MLflow's tracking URI (None: the default sqlite file beside a local store) reachable: a sqlite
    file writable, an http(s) server answering ``/health`` within ``timeout_s``."""
    return _redacted(_tracking_check(uri, store_url, enabled, timeout_s))


def _tracking_check(uri: str | None, store_url: str, enabled: bool, timeout_s: float) -> Check:
    if not enabled:
        return Check("tracking", "ok", "disabled (tracking.enabled=false)")
    from verl_core.runtime.tracking import default_tracking_uri

    uri = uri or default_tracking_uri(store_url, create=False)
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        target = db if db.exists() else db.parent
        ok = os.access(db, os.W_OK) if db.exists() else _writable_dir(db.parent)[0]
        if ok:
            return Check("tracking", "ok", f"{uri} writable")
        fix = "tracking.uri: sqlite:///<a writable path>/mlflow.db, or tracking.enabled=false"
        return Check("tracking", "error", f"{uri}: {target} is not writable", "writable", fix)
    if uri.startswith("file:") or "://" not in uri:
        # MLflow 3.17: the file store raises unless MLFLOW_ALLOW_FILE_STORE=true ("maintenance mode").
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() != "true":
            fix = "export MLFLOW_ALLOW_FILE_STORE=true, or tracking.uri: sqlite:///path/mlflow.db"
            return Check("tracking", "error", f"{uri}: MLflow's file store is off by default", "", fix)
        return Check("tracking", "ok", f"{uri} (file store)")
    if uri.startswith(("http://", "https://")):
        fix = (
            f"start the MLflow server at {uri} (mlflow server), or set tracking.uri / tracking.enabled=false"
        )
        return _within(timeout_s, lambda: _http_health(uri, timeout_s), "tracking", uri, fix)
    return Check("tracking", "warn", f"{uri}: not checked (scheme not known to the doctor)")


def _http_health(uri: str, timeout_s: float) -> Check:
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(uri.rstrip("/"))
    host = parts.netloc.rsplit("@", 1)[-1]  # /health needs no credentials (MLflow reads them from env)
    url = urllib.parse.urlunsplit((parts.scheme, host, f"{parts.path}/health", "", ""))
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # http(s) only: checked above
        status = response.status
    if status == 200:
        return Check("tracking", "ok", f"{uri} healthy")
    return Check(
        "tracking", "error", f"{url} answered HTTP {status}", "HTTP 200", f"check the server at {uri}"
    )
