"""Shared by the tests that start a real Prefect server: wait until it answers."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_healthy(
    api_url: str, timeout: float = 120.0, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None
) -> None:
    """Return once ``{api_url}/health`` answers ``true``; raise if ``proc`` (the server) exits first or
    ``timeout`` seconds pass, with the tail of ``log`` (the server's output) in the message."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
                if r.read().strip() == b"true":
                    return
        except OSError:
            pass
        if (proc is not None and proc.poll() is not None) or time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"Prefect server at {api_url} not healthy after {timeout:g} s: {tail}")
        time.sleep(0.5)
