"""The one HTTP client of the remote and judge scorers: a bearer token read from an environment
variable, connect/read timeouts, retries with exponential backoff and full jitter, and a bounded
number of requests in flight (a thread pool over one ``httpx.Client``).

What each answer to one POST leads to:

=====================================  ======================  ==============================================
answer                                 retried                 then
=====================================  ======================  ==============================================
connection error, timeout, 429, 5xx    up to ``max_retries``   the request's samples errored (``on_error``)
401, 403, 404                          no                      :class:`RemoteConfigError`: the stage fails
                                                               whatever ``on_error`` says (wrong token, URL or
                                                               model: a configuration problem, not a sample's)
other non-2xx (400, 413, 422, 3xx...)  no                      the request's samples errored
2xx whose body is not JSON             no                      the request's samples errored
=====================================  ======================  ==============================================

Wait before retry k (k = 0, 1, ...): uniform(0, min(max_backoff_s, backoff_s * 2**k)) ("full jitter",
AWS architecture blog 2015), or the server's ``Retry-After`` seconds when larger (capped the same).
Worst case for one request: (max_retries + 1) * (connect + read timeout) plus the waits.

The token is read when a batch is scored, sent only in the ``Authorization`` header, and blanked out
of every message built here, so a server that echoes it back cannot leak it into logs or artifacts.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any, NamedTuple, TypeVar

import httpx

from verl_core.errors import ConfigError
from verl_core.runtime.watchdog import beat

T = TypeVar("T")
R = TypeVar("R")

_FATAL = {401: "unauthorized", 403: "forbidden", 404: "not found"}
_EXCERPT = 200  # characters of a bad body quoted in an error


class RemoteConfigError(ConfigError):
    """The endpoint refused us as configured (401/403/404) or the token variable is unset."""


class HttpOptions(NamedTuple):
    """Client settings shared by the remote scorers (see the module docstring for what they do)."""

    token_env: str | None
    connect_timeout_s: float
    read_timeout_s: float
    max_retries: int
    backoff_s: float
    max_backoff_s: float
    max_concurrency: int


class Reply(NamedTuple):
    """One request's outcome: the parsed JSON body, or what went wrong; ``retries`` it took."""

    body: Any
    error: str | None
    retries: int


class RequestStats(NamedTuple):
    """Counts of a scorer call, reported as ``reward/{scorer}/{field}`` metrics."""

    requests: int
    retries: int
    failed_requests: int

    def metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._asdict().items()}


def read_token(token_env: str | None) -> str | None:
    """The bearer token from environment variable ``token_env`` (None: no auth). Raises
    RemoteConfigError naming the variable (never a value) when it is unset or empty."""
    if token_env is None:
        return None
    token = os.environ.get(token_env)
    if not token:
        raise RemoteConfigError(
            f"environment variable {token_env} (the scorer's token_env) is not set: it must hold the token"
        )
    return token


def make_client(options: HttpOptions) -> httpx.Client:
    """A client for ``options.max_concurrency`` threads (read timeout also bounds writes and the wait
    for a pooled connection)."""
    timeout = httpx.Timeout(options.read_timeout_s, connect=options.connect_timeout_s)
    limits = httpx.Limits(max_connections=options.max_concurrency)
    return httpx.Client(timeout=timeout, limits=limits)


def _redact(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text


def _excerpt(text: str, token: str | None) -> str:
    text = _redact(text, token)
    return repr(text[:_EXCERPT] + ("..." if len(text) > _EXCERPT else ""))


def backoff_s(retry: int, options: HttpOptions, retry_after: float | None, rng: random.Random) -> float:
    """Seconds to wait before retry ``retry`` (0-based): full jitter, at least ``Retry-After``."""
    cap = min(options.max_backoff_s, options.backoff_s * 2**retry)
    wait = rng.uniform(0, cap)
    if retry_after is not None:
        wait = max(wait, min(retry_after, options.max_backoff_s))
    return wait


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None  # absent, or an HTTP date (rare for APIs): fall back to the jittered wait


def post_json(
    client: httpx.Client,
    url: str,
    payload: Any,
    options: HttpOptions,
    token: str | None,
    *,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> Reply:
    """POST ``payload`` as JSON to ``url`` with retries (module docstring). Never raises for a failed
    request, except RemoteConfigError on 401/403/404."""
    rng = rng or random.Random()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    content = json.dumps(payload, default=str).encode()
    retries = 0
    while True:
        retry_after = None
        try:
            response = client.post(url, content=content, headers=headers)
        except httpx.TimeoutException as e:
            limits = (
                f"connect_timeout_s={options.connect_timeout_s} / read_timeout_s={options.read_timeout_s}"
            )
            problem = f"{type(e).__name__}: no answer from {url} within {limits}"
        except httpx.TransportError as e:
            problem = f"{type(e).__name__} on {url}: {_redact(str(e), token)}"
        else:
            status = response.status_code
            if status in _FATAL:
                auth = (
                    f"the bearer token from environment variable {options.token_env} was not accepted"
                    if options.token_env
                    else "no bearer token was sent (set token_env to the variable holding one)"
                )
                why = auth if status in (401, 403) else "wrong URL (or model name)"
                raise RemoteConfigError(
                    f"{url} answered HTTP {status} ({_FATAL[status]}): {why}; a configuration problem, so "
                    f"scoring stops whatever on_error says. Body: {_excerpt(response.text, token)}"
                )
            if 200 <= status < 300:
                try:
                    return Reply(response.json(), None, retries)
                except ValueError:
                    problem = f"{url} answered HTTP {status} with a body that is not JSON"
                    return Reply(None, f"{problem}: {_excerpt(response.text, token)}", retries)
            problem = f"{url} answered HTTP {status}: {_excerpt(response.text, token)}"
            if status != 429 and status < 500:
                return Reply(None, problem, retries)  # the request itself is wrong: retrying cannot help
            retry_after = _retry_after(response)
        if retries >= options.max_retries:
            return Reply(None, f"{problem} (gave up after {retries} retries)", retries)
        sleep(backoff_s(retries, options, retry_after, rng))
        retries += 1


def run_bounded(fn: Callable[[T], R], items: Sequence[T], max_concurrency: int, *, progress: str) -> list[R]:
    """``[fn(x) for x in items]`` with at most ``max_concurrency`` calls running at once (threads);
    beats the stage watchdog as calls finish (``progress``: the counter's name). An exception of any
    call cancels the calls not yet started and is raised."""
    if not items:
        return []
    out: list[Any] = [None] * len(items)
    pool = ThreadPoolExecutor(max_workers=min(max_concurrency, len(items)), thread_name_prefix="reward-http")
    try:
        futures: dict[Future[R], int] = {pool.submit(fn, x): i for i, x in enumerate(items)}
        for done, future in enumerate(as_completed(futures), 1):
            out[futures[future]] = future.result()
            beat(**{progress: done})
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return out
