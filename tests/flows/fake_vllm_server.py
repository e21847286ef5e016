"""A stand-in for vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server ...``) for the
serve lifecycle tests: it answers ``/health`` and ``/v1/models`` (the served names, ``root`` = the
``--model`` path, as vLLM does) within a second, prints its arguments (the log), and has a child
process in its group (vLLM's engine core is one) that outlives it unless the whole group is stopped.

``FAKE_VLLM_MODELS_AS``: list these names instead of the given ones (another server's answer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _arg(argv: list[str], flag: str) -> list[str]:
    """The values after ``flag`` up to the next flag."""
    if flag not in argv:
        return []
    rest = argv[argv.index(flag) + 1 :]
    values = []
    for value in rest:
        if value.startswith("--"):
            break
        values.append(value)
    return values


def main(argv: list[str]) -> None:
    print(f"fake vLLM pid {os.getpid()}:", json.dumps(argv), flush=True)
    names = (
        os.environ.get("FAKE_VLLM_MODELS_AS", "").split(",")
        if os.environ.get("FAKE_VLLM_MODELS_AS")
        else None
    )
    names = names or _arg(argv, "--served-model-name")
    root = _arg(argv, "--model")[0]
    body = json.dumps(
        {"object": "list", "data": [{"id": n, "object": "model", "root": root} for n in names]}
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/health", "/v1/models"):
                self.send_error(404)
                return
            data = body if self.path == "/v1/models" else b""
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    subprocess.Popen(["sleep", "600"])  # the engine's stand-in: same process group, not our child's wait
    server = ThreadingHTTPServer((_arg(argv, "--host")[0], int(_arg(argv, "--port")[0])), Handler)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
