"""Which Prefect API ``verl-flow run`` talks to, where that setting came from, and a quick check that
it answers before the flow starts: an unreachable ``PREFECT_API_URL`` fails in one line that names
the URL, its origin and the two ways out, instead of Prefect's retries and traceback."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from typing import NamedTuple
from urllib.parse import urlsplit

from verl_core.errors import VerlFlowError

HEALTH_TIMEOUT_S = 3.0  # a local server answers /health in milliseconds, even on a busy 2-core box


class PrefectApiError(VerlFlowError):
    """The configured Prefect API does not answer."""


class ApiSetting(NamedTuple):
    """The configured ``PREFECT_API_URL``, where it was set and the command that unsets it there."""

    url: str
    origin: str  # "the environment variable PREFECT_API_URL", "profile 'x' in /path/profiles.toml"
    unset: str  # e.g. "unset PREFECT_API_URL"


def configured_api() -> ApiSetting | None:
    """``PREFECT_API_URL`` as Prefect will read it; None: no URL, the flow uses a temporary server."""
    env = os.environ.get("PREFECT_API_URL", "")
    if env:
        return ApiSetting(env, "the environment variable PREFECT_API_URL", "unset PREFECT_API_URL")
    from prefect.settings import PREFECT_API_URL, get_current_settings, load_current_profile

    url = get_current_settings().api.url
    if not url:
        return None
    profile = load_current_profile()
    if profile.settings.get(PREFECT_API_URL):
        where = f"profile {profile.name!r} in {profile.source}"
        return ApiSetting(url, where, f"prefect --profile {profile.name} config unset PREFECT_API_URL")
    # neither the environment nor the profile: .env, prefect.toml or pyproject.toml of this directory
    where = f"a Prefect settings file in {os.getcwd()} (.env, prefect.toml or pyproject.toml)"
    return ApiSetting(url, where, "remove PREFECT_API_URL from that file")


def check_api(timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Raise :class:`PrefectApiError` (one line) when the configured API does not answer
    ``GET {url}/health`` within ``timeout_s``. An HTTP error status means a server answered: Prefect
    reports what is wrong with it."""
    api = configured_api()
    if api is None:
        return
    try:
        with urllib.request.urlopen(f"{api.url.rstrip('/')}/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise PrefectApiError(
            f"the Prefect API {api.url} (from {api.origin}) is not reachable ({reason}): "
            f"start the server ({_start_command(api.url)}), or run `{api.unset}` to use "
            "a temporary server started for the run"
        ) from None


def _start_command(url: str) -> str:
    """``infra/local/prefect_server.sh PORT`` for a local URL, else where to start one."""
    parts = urlsplit(url)
    if parts.hostname in ("127.0.0.1", "localhost"):
        return f"`infra/local/prefect_server.sh {parts.port or 4200}`"
    return f"`prefect server start` on {parts.hostname}"


def api_failure(exc: BaseException) -> str | None:
    """One line for a run that failed because the Prefect API stopped answering mid-run (the server
    restarted for longer than the client's retries, or went away), naming the server; None when
    ``exc`` (or what it was raised from or during) is not a connection failure."""
    import httpx

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, httpx.TransportError):
            api = configured_api()
            error = f"{type(cause).__name__}: {' '.join(str(cause).split()) or 'no answer'}"
            if api is None:
                return (
                    f"the run's temporary Prefect server stopped answering mid-run ({error}): rerun to resume"
                )
            return (
                f"the Prefect API {api.url} (from {api.origin}) stopped answering mid-run ({error}): what "
                f"was committed is intact; when it answers again ({_start_command(api.url)}), rerun the "
                "same command to resume"
            )
        cause = cause.__cause__ or cause.__context__
    return None
