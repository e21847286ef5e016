"""A stand-in for ``python -m verl_core.rollout.vllm_process`` (no vLLM): it answers every frame of the
channel and records each request, and the environment variables named in ``$FAKE_HOST_ENV``, as JSON
lines in ``$FAKE_HOST_LOG``. ``$FAKE_HOST_CAN_SLEEP=1``: the platform has sleep mode. The frames are
the channel's (an 8-byte little-endian length, then JSON), written here without importing verl_core
(torch and transformers would take most of a test's time)."""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any


def read_frame(stream: IO[bytes]) -> Any:
    head = stream.read(8)
    return json.loads(stream.read(int.from_bytes(head, "little"))) if len(head) == 8 else None


def write_frame(stream: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def main() -> int:
    channel_in, channel_out = sys.stdin.buffer, sys.stdout.buffer
    names = [n for n in os.environ.get("FAKE_HOST_ENV", "").split(",") if n]
    with open(os.environ["FAKE_HOST_LOG"], "a") as log:
        while (request := read_frame(channel_in)) is not None:
            log.write(json.dumps(request) + "\n")
            log.flush()
            if request["op"] == "close":
                return 0
            result: dict[str, object] = {}
            if request["op"] == "start":
                env = {n: os.environ.get(n) for n in names}
                result = {"can_sleep": os.environ.get("FAKE_HOST_CAN_SLEEP") == "1", "env": env}
            elif request["op"] == "generate":
                result = {"completions": []}
            write_frame(channel_out, {"ok": True, "result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
