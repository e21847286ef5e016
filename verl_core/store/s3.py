"""S3 through s3fs, riding out an endpoint that is down for a while.

botocore's retries (``store.max_attempts``, standard mode) absorb per-request faults: a 503, a reset
connection. An endpoint that refuses every connection for a minute or two (a restart, a fail-over, a
network partition) outlasts them. :class:`OutageTolerantS3FileSystem` retries a request that failed
because the endpoint is unreachable (:data:`UNREACHABLE`: connection refused, reset or closed,
connect/read timeouts) with exponential backoff (``FIRST_DELAY_S``, doubling, at most
``MAX_DELAY_S``) while the outage has lasted less than ``outage_budget_s``, and then raises
:class:`~verl_core.errors.StoreUnavailableError`: one line naming the store, how long it was
unreachable, the setting, the last error, and that a rerun resumes. Any error the endpoint *answers*
(404, 403, a failed condition of :mod:`verl_core.store.cas` ...) passes through unchanged.

The outage clock belongs to the endpoint, not to one request: it starts when the first request that
failed after the last success was sent, whichever request it was, and every filesystem instance of
the process shares it (fsspec keeps one instance per thread). The failure therefore comes at most
``outage_budget_s`` plus one request's own botocore retries (``store.max_attempts`` attempts: a few
seconds at 3, up to about a minute at the default 10) after the outage began. Once an outage has
outlasted the budget, further requests fail at once, without reaching the endpoint, until
``MAX_DELAY_S`` after the last failed one; the next request then probes the endpoint again. So a
failing run's cleanup (Prefect task retries, releasing the lease) is not held up by the dead
endpoint, and a long-lived process notices when the store is back. One warning is logged when an
outage starts and one when it ends.

Retrying a request that may have been applied before its connection broke is what botocore does
already; the writes of verl-flow are idempotent or conditional (a retried conditional write shows up
as a failed condition, which :mod:`verl_core.store.lease` handles).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import HTTPClientError
from fsspec.asyn import sync_wrapper
from s3fs import S3FileSystem

from verl_core.errors import StoreUnavailableError

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 15.0
# The endpoint could not be reached: botocore's EndpointConnectionError, ConnectTimeoutError,
# ProxyConnectionError (ConnectionError), ConnectionClosedError, ReadTimeoutError (HTTPClientError),
# aiohttp's connection errors and the builtin ones (refused, reset, aborted) where nothing wraps them.
UNREACHABLE: tuple[type[BaseException], ...] = (
    BotoConnectionError,
    HTTPClientError,
    aiohttp.ClientConnectionError,
    ConnectionError,
)
log = logging.getLogger(__name__)
T = TypeVar("T")


class Outage:
    """Whether one endpoint is unreachable, since when, and whether the budget was spent on it."""

    def __init__(self) -> None:
        self.since: float | None = None  # when the first request failing since the last success was sent
        self.last_failure = 0.0
        self.last_error = ""
        self.given_up = False
        self._lock = threading.Lock()

    def failed(self, sent: float, now: float, store_url: str, error: BaseException, budget_s: float) -> float:
        """Record a request sent at ``sent`` that failed at ``now``; returns when the outage began:
        when its first failed request was sent (logged once)."""
        with self._lock:
            self.last_failure, self.last_error = now, describe(error)
            if self.since is None:
                self.since = sent
                log.warning(
                    "store %s: unreachable (%s); retrying for up to %g s (store.outage_budget_s)",
                    store_url,
                    self.last_error,
                    budget_s,
                )
            return self.since

    def succeeded(self, now: float, store_url: str) -> None:
        if self.since is None:  # the common case, without the lock
            return
        with self._lock:
            if self.since is not None:
                log.warning("store %s: reachable again after %.0f s", store_url, now - self.since)
            self.since, self.given_up = None, False

    def give_up(self) -> None:
        with self._lock:
            self.given_up = True

    def fail_fast(self, now: float) -> float | None:
        """How long the outage has lasted, if a request should fail without trying: the budget
        was spent on it and the endpoint failed less than ``MAX_DELAY_S`` ago; else None."""
        with self._lock:
            if self.since is None or not self.given_up or now - self.last_failure >= MAX_DELAY_S:
                return None
            return now - self.since


_OUTAGES: dict[str, Outage] = {}
_OUTAGES_LOCK = threading.Lock()


def outage_of(endpoint: str) -> Outage:
    """The process-wide :class:`Outage` of ``endpoint``."""
    with _OUTAGES_LOCK:
        return _OUTAGES.setdefault(endpoint, Outage())


async def call_within_budget(
    call: Callable[[], Awaitable[T]],
    *,
    outage: Outage,
    budget_s: float,
    store_url: str,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> T:
    """``await call()``, retried with backoff while it fails with :data:`UNREACHABLE` and ``outage``
    has lasted under ``budget_s``; then :class:`StoreUnavailableError`. The last wait is cut short
    so that the last try falls on the budget."""
    delay = FIRST_DELAY_S
    while True:
        spent = outage.fail_fast(clock())
        if spent is not None:
            raise _unavailable(store_url, spent, budget_s, outage.last_error)
        sent = clock()
        try:
            result = await call()
        except UNREACHABLE as e:
            now = clock()
            elapsed = now - outage.failed(sent, now, store_url, e, budget_s)
            if elapsed >= budget_s:
                outage.give_up()
                raise _unavailable(store_url, elapsed, budget_s, outage.last_error) from None
            await sleep(min(delay, budget_s - elapsed))
            delay = min(2 * delay, MAX_DELAY_S)
        else:
            outage.succeeded(clock(), store_url)
            return result


def _unavailable(store_url: str, elapsed: float, budget_s: float, last_error: str) -> StoreUnavailableError:
    return StoreUnavailableError(
        f"store {store_url}: unreachable for {elapsed:.0f} s, longer than store.outage_budget_s="
        f"{budget_s:g} (last error {last_error}); what was committed is intact: rerun once the store "
        "is back to resume"
    )


def describe(error: BaseException, limit: int = 100) -> str:
    """``Type: message`` on one line, the message cut to ``limit`` characters."""
    text = " ".join(str(error).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class OutageTolerantS3FileSystem(S3FileSystem):
    """s3fs whose every request (``_call_s3``, which listings, reads, writes and :mod:`cas` go
    through) rides out an unreachable endpoint for ``outage_budget_s`` (see the module docstring).
    ``store_url`` names the store in messages."""

    def __init__(self, *args: Any, store_url: str, outage_budget_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store_url, self.outage_budget_s = store_url, outage_budget_s
        self.outage = outage_of(self.endpoint_url or "aws")

    async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
        parent = super()._call_s3
        return await call_within_budget(
            lambda: parent(method, *akwarglist, **kwargs),
            outage=self.outage,
            budget_s=self.outage_budget_s,
            store_url=self.store_url,
        )

    # s3fs binds its sync twin to its own _call_s3; S3File and cas.py call this one
    call_s3 = sync_wrapper(_call_s3)


def s3_filesystem(
    url: str, options: dict[str, Any], outage_budget_s: float
) -> tuple[OutageTolerantS3FileSystem, str]:
    """The filesystem and root path of the ``s3://`` store at ``url`` (as ``fsspec.core.url_to_fs``
    with ``options`` would give, riding out outages)."""
    cls = OutageTolerantS3FileSystem
    kwargs = {**cls._get_kwargs_from_urls(url), **options}
    fs = cls(store_url=url, outage_budget_s=outage_budget_s, **kwargs)
    return fs, str(cls._strip_protocol(url))
