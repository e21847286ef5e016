"""A fault-injecting HTTP reverse proxy for an S3-compatible endpoint, on 127.0.0.1.

Each request is, with probability ``rate`` (seeded), hit by one fault drawn from ``kinds``:

    500          answered ``500 InternalError`` (S3's XML error body) without reaching the endpoint
    503          answered ``503 SlowDown`` without reaching the endpoint
    reset        the connection is reset (RST) before the request is forwarded
    reset-after  the request *is* forwarded and applied, then the connection is reset before the
                 response: the client cannot tell whether it happened and must retry safely
    delay        forwarded after ``delay_s`` seconds

Only requests whose method is in ``methods`` (all when None) draw a fault; everything else is forwarded
unchanged. ``counts`` holds the faults injected by kind, ``requests``
the requests seen. The clients under test are expected to survive through their configured retries
(botocore's standard retry mode through s3fs, Prefect task retries) - nothing here retries.

An outage instead of per-request faults: between :meth:`FaultProxy.down` and :meth:`FaultProxy.up`
(or during :meth:`FaultProxy.outage`) the endpoint is gone: the listening socket is closed, so every
connection is refused, and open keep-alive connections are cut (``dropped`` counts them). ``up``
listens on the same port again.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("500", "503", "reset", "reset-after", "delay")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te"}
_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again. (injected)"),
    503: ("SlowDown", "Please reduce your request rate. (injected)"),
}


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.1,
        seed: int = 0,
        kinds: tuple[str, ...] = KINDS,
        delay_s: float = 0.3,
        methods: tuple[str, ...] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rate, self.kinds, self.delay_s, self.methods = rate, kinds, delay_s, methods
        self.counts: Counter[str] = Counter()
        self.requests = 0
        self.dropped = 0  # open connections cut by down()
        self.is_down = False
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._server = self._listen(0)
        self._port = int(self._server.server_address[1])
        self._thread = self._serve_thread()

    def _listen(self, port: int) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))  # SO_REUSEADDR: rebinds at once
        server.daemon_threads = True
        return server

    def _serve_thread(self) -> threading.Thread:
        return threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def faults(self) -> int:
        return sum(self.counts.values())

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        if not self.is_down:
            self._server.shutdown()
            self._server.server_close()

    def down(self) -> None:
        """The endpoint is gone: new connections are refused, open ones are cut."""
        with self._lock:
            self.is_down = True
            open_now = list(self._connections)
        self._server.shutdown()
        self._server.server_close()
        for conn in open_now:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the handler blocked reading the next request
            except OSError:
                continue
            self.dropped += 1

    def up(self) -> None:
        """The endpoint is back, on the same port."""
        deadline = time.monotonic() + 10
        while True:
            try:
                self._server = self._listen(self._port)
                break
            except OSError:  # e.g. a client's ephemeral port took it meanwhile: rare, brief
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        with self._lock:
            self.is_down = False
        self._thread = self._serve_thread()
        self._thread.start()

    @contextmanager
    def outage(self) -> Iterator[None]:
        """Down for the ``with`` block, then up."""
        self.down()
        try:
            yield
        finally:
            self.up()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def draw(self, method: str) -> str | None:
        """The fault for the next request, or None."""
        with self._lock:
            self.requests += 1
            if self.methods is not None and method not in self.methods:
                return None
            if self._rng.random() >= self.rate:
                return None
            kind = self._rng.choice(self.kinds)
            self.counts[kind] += 1
            return kind


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def setup(self) -> None:
            super().setup()
            with proxy._lock:
                proxy._connections.add(self.connection)

        def finish(self) -> None:
            with proxy._lock:
                proxy._connections.discard(self.connection)
            with suppress(OSError):  # cut by down()
                super().finish()

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _reset(self) -> None:
            # SO_LINGER with a zero timeout: close() sends RST instead of FIN
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True

        def _error(self, status: int) -> None:
            code, message = _ERRORS[status]
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{message}</Message><RequestId>injected</RequestId></Error>"
            ).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            finally:
                conn.close()

        def _handle(self) -> None:
            try:
                self._proxy()
            except OSError:  # the client went away (e.g. killed), or down() cut the connection
                self.close_connection = True

        def _proxy(self) -> None:
            body = self._body()
            if proxy.is_down:  # accepted just before down(): cut like the rest
                self._reset()
                return
            fault = proxy.draw(self.command)
            if fault in ("500", "503"):
                self._error(int(fault))
                return
            if fault == "reset":
                self._reset()
                return
            if fault == "delay":
                time.sleep(proxy.delay_s)
            status, reason, headers, data = self._forward(body)
            if fault == "reset-after":
                self._reset()
                return
            self.send_response(status, reason)
            head = self.command == "HEAD"  # a HEAD answer keeps the object's Content-Length
            for k, v in headers:
                if k.lower() not in _HOP_BY_HOP and (head or k.lower() != "content-length"):
                    self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler
