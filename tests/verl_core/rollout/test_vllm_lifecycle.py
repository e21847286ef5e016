"""The subprocess vLLM engine's lifecycle without vLLM, against a stand-in subprocess
(``fake_vllm_host.py``, which records every request): the engine's own environment, the spec sent as
JSON, sleep → wake_up → reload → generate through the channel, old adapter directories removed (the
same lifecycle as the in-process engine's, ``test_vllm_engine_fake.py``)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_core.models.loading import apply_lora
from verl_core.rollout import SamplingParams, VLLMProcessEngine
from verl_core.rollout.vllm_spec import VLLMSpec

from .conftest import tiny_model, vllm_spec

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
    engine = VLLMProcessEngine("some/model", None, vllm_spec(), python=python, env=env)
    try:
        assert engine.info["env"] == env
    finally:
        engine.close()
    plain = VLLMProcessEngine("some/model", None, vllm_spec(), python=python)  # no env: this process's
    try:
        assert plain.info["env"] == {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_CPU_OMP_THREADS_BIND": None}
    finally:
        plain.close()
    assert [r["op"] for r in host_requests(tmp_path)] == ["start", "close", "start", "close"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_lora_policy_through_the_channel_sleeps_wakes_and_keeps_two_adapter_dirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: Any
) -> None:
    python = fake_python(tmp_path, monkeypatch, can_sleep=True)
    peft = apply_lora(tiny_model(tok, seed=5), rank=8, alpha=16, dropout=0.0, target_modules="all-linear")
    spec = vllm_spec(dtype="bfloat16", kv_cache_gib=2.0)
    engine = VLLMProcessEngine(peft, tok, spec, python=python)
    try:
        assert engine.can_sleep
        for version in (1, 2, 3):
            engine.update_weights(peft, version)
        root = Path(engine._adapter_root)
        # four adapters sent (the first at start): the current one and the one before stay on disk
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("adapter-")) == [
            "adapter-3",
            "adapter-4",
        ]
        engine.sleep()  # the trainer's turn
        engine.update_weights(peft, 4)  # wakes first
        engine.generate(["Q: 1 + 2"], SamplingParams(max_new_tokens=1, seed=0))
    finally:
        engine.close()
    start, *requests = host_requests(tmp_path)
    # the spec crosses as JSON, with the policy's LoRA rank (vLLM's allowed rank is chosen there)
    assert VLLMSpec.from_json(start["spec"]) == spec and start["lora_rank"] == 8
    ops = [r["op"] for r in requests]
    assert ops == [*["load_adapter_dir"] * 4, "sleep", "wake_up", "load_adapter_dir", "generate", "close"]
    assert requests[-3]["path"].endswith("adapter-5") and requests[-3]["version"] == 4


def test_without_sleep_mode_nothing_sleeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: Any) -> None:
    python = fake_python(tmp_path, monkeypatch, can_sleep=False)  # the CPU platform
    model = tiny_model(tok)
    engine = VLLMProcessEngine(model, tok, vllm_spec(), python=python)
    try:
        engine.sleep()
        engine.load_weights(model.state_dict().items(), 1)
        engine.wake_up()
        assert engine.policy_version == 1
    finally:
        engine.close()
    assert [r["op"] for r in host_requests(tmp_path)] == ["start", "load_staged_weights", "close"]
