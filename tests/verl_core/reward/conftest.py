"""A local HTTP scoring server for the remote and judge scorers (stdlib ``http.server`` in a thread on
127.0.0.1, a free port), with switchable misbehaviour."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class ServerState:
    """What the server does (set by a test) and what it saw.

    mode: "ok" (score = 1.0 when response == ground_truth else 0.0; a response "ERR" gets a
    per-sample error), "hang" (never answers until the test ends), "not_json", "wrong_length",
    "not_object", "nan", "status" (answer ``status`` with ``body``).
    fail_first: answer the first this-many requests with ``fail_status`` (then ``mode``).
    token: when set, requests without ``Authorization: Bearer {token}`` get 401, echoing the header.
    delay_s: seconds each request takes (to measure concurrency)."""

    mode: str = "ok"
    token: str | None = None
    fail_first: int = 0
    fail_status: int = 503
    status: int = 400
    body: str = "bad request"
    delay_s: float = 0.0
    judge_replies: dict[str, str] = field(default_factory=dict)  # response text -> judge's reply
    requests: list[dict[str, Any]] = field(default_factory=list)  # bodies received
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    release: threading.Event = field(default_factory=threading.Event)  # ends "hang"


class FakeServer:
    def __init__(self) -> None:
        self.state = ServerState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)


def _handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

        def _send(self, status: int, body: str | bytes, headers: dict[str, str] | None = None) -> None:
            data = body.encode() if isinstance(body, str) else body
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.requests.append(payload)
                n_seen = len(state.requests)
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if state.delay_s:
                    state.release.wait(state.delay_s)
            finally:
                # counted out before the answer is written: once the client has the answer it may
                # send its next request, which must not find this one still counted
                with state.lock:
                    state.in_flight -= 1
            self._answer(payload, n_seen)

        def _answer(self, payload: dict[str, Any], n_seen: int) -> None:
            auth = self.headers.get("Authorization")
            if state.token is not None and auth != f"Bearer {state.token}":
                return self._send(401, json.dumps({"error": "bad token", "you_sent": auth}))
            if n_seen <= state.fail_first:
                return self._send(state.fail_status, "busy", {"Retry-After": "0"})
            if state.mode == "hang":
                state.release.wait(30)
                return self._send(200, "{}")
            if state.mode == "status":
                return self._send(state.status, state.body)
            if self.path.endswith("/chat/completions"):
                content = payload["messages"][0]["content"]
                reply = next((v for k, v in state.judge_replies.items() if f"<<{k}>>" in content), "?")
                return self._send(200, json.dumps({"choices": [{"message": {"content": reply}}]}))
            samples = payload["samples"]
            scores: list[Any] = [float(s["response"] == s["ground_truth"]) for s in samples]
            errors = [("grader crashed" if s["response"] == "ERR" else None) for s in samples]
            if state.mode == "not_json":
                return self._send(200, "<html>Bad Gateway</html>")
            if state.mode == "wrong_length":
                scores = scores[:-1]
            if state.mode == "not_object":
                return self._send(200, json.dumps(scores))
            if state.mode == "nan":
                return self._send(200, re.sub(r"\d\.\d", "NaN", json.dumps({"scores": scores})))
            self._send(200, json.dumps({"scores": scores, "errors": errors}))

    return Handler


@pytest.fixture
def scoring_server() -> Iterator[FakeServer]:
    """A fresh local scoring server per test; ``.url`` its base, ``.state`` its behaviour and log."""
    server = FakeServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.state.release.set()  # frees hung handlers
        server.httpd.shutdown()
        server.httpd.server_close()
