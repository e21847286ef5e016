"""A run's fingerprint leaves out exactly the per-process values: two runs whose trainer states differ
only in Python's RNG state (which nothing in training draws from) fingerprint alike, a changed
tensor or a changed plain file does not; a wall-clock report series is left out, another is not."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stages.floor.fingerprint import fingerprint
from verl_core.models.checkpoint import state_bytes
from verl_core.store import ArtifactStore


def _run(
    root: Path, run_id: str, *, python_rng: int, weight: float, stage_seconds: float, loss: float
) -> str:
    store = ArtifactStore(str(root))
    w = store.open_stage(run_id, "ckpt/iter-0001")
    state = {"w": torch.full((2, 3), weight), "rng": {"torch": torch.zeros(4, dtype=torch.uint8)}}
    state["rng"]["python_state"] = torch.tensor([python_rng])  # differs between any two processes
    w.write_bytes("trainer.pt", state_bytes(state))
    w.write_bytes("policy/model.safetensors", b"weights")
    w.commit()
    w = store.open_stage(run_id, "report")
    w.write_json("metrics.json", {"series": {"timing_s/rollout": [stage_seconds], "actor/loss": [loss]}})
    w.commit()
    return str(root)


def test_only_per_process_values_are_left_out(tmp_path: Path) -> None:
    base = dict(python_rng=1, weight=0.5, stage_seconds=3.0, loss=0.25)
    a = fingerprint(_run(tmp_path / "a", "r", **base), "r")
    assert set(a) == {
        "ckpt/iter-0001/trainer.pt",
        "ckpt/iter-0001/policy/model.safetensors",
        "report/metrics.json",
    }
    # another process: Python's RNG and the wall clock differ, nothing else
    assert fingerprint(_run(tmp_path / "b", "r", **{**base, "python_rng": 2, "stage_seconds": 9.0}), "r") == a
    # a trained value that differs is seen, in the state and in the metrics
    assert fingerprint(_run(tmp_path / "c", "r", **{**base, "weight": 0.75}), "r") != a
    assert fingerprint(_run(tmp_path / "d", "r", **{**base, "loss": 0.5}), "r") != a
    assert json.dumps(a)  # plain strings, savable as benchmarks/determinism.py --save does
