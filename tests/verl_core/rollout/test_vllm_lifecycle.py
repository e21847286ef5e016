"""The vLLM engines' lifecycle without vLLM: the process engine against a stand-in subprocess
(``fake_vllm_host.py``, which records every request)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_core.rollout import VLLMProcessEngine

HOST = Path(__file__).with_name("fake_vllm_host.py")


def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, can_sleep: bool = False) -> str:
    """An "interpreter" that runs the stand-in host whatever it is asked to run."""
    script = tmp_path / "python"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {HOST} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_HOST_LOG", str(tmp_path / "host.jsonl"))
    monkeypatch.setenv("FAKE_HOST_CAN_SLEEP", "1" if can_sleep else "0")
    monkeypatch.setenv("FAKE_HOST_ENV", "CUDA_VISIBLE_DEVICES,VLLM_CPU_OMP_THREADS_BIND")
    return str(script)


def host_requests(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "host.jsonl").read_text().splitlines()]


def test_the_engine_subprocess_gets_the_extra_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # this process's: the engine's own wins
    python = fake_python(tmp_path, monkeypatch)
    env = {"CUDA_VISIBLE_DEVICES": "1", "VLLM_CPU_OMP_THREADS_BIND": "2-3"}
    engine = VLLMProcessEngine("some/model", python=python, env=env)
    try:
        assert engine.info["env"] == env
    finally:
        engine.close()
    plain = VLLMProcessEngine("some/model", python=python)  # no env: this process's environment
    try:
        assert plain.info["env"] == {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_CPU_OMP_THREADS_BIND": None}
    finally:
        plain.close()
    assert [r["op"] for r in host_requests(tmp_path)] == ["start", "close", "start", "close"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
