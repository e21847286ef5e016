"""Full-state checkpoints move between world sizes: FSDP2 at 2 ranks (gloo) ↔ one process.

The reference is one uninterrupted 4-step FSDP2 run at world 2 (fsdp_worker's SFT batch). Resuming
its step-2 checkpoint at world 1 and at world 2, and resuming a one-process step-2 checkpoint at world
2, must give the same losses for steps 3-4 (rel 1e-4) and the same final weights
(max|Δ|/max|w| ≤ 1e-5). The same launch checks that FSDP2's CPU offload builds and steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.verl_core.training import fsdp_checkpoint_worker as worker
from tests.verl_core.training.fsdp_worker import OPTIM, make_model, run_steps
from verl_core.training.distributed import full_model_state, load_full_model_state
from verl_core.training.engine import SingleStrategy, TrainEngine

REPO = Path(__file__).resolve().parents[3]


def relative_max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max|a − b| / max|a| over all tensors of two state dicts with the same keys."""
    assert a.keys() == b.keys()
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    return diff / max(float(a[k].float().abs().max()) for k in a)


def single_checkpoint(path: Path) -> None:
    """Two steps in one process, then the checkpoint as a stage would write it."""
    engine = TrainEngine(make_model(), OPTIM)
    run_steps(engine, None, 2)
    torch.save({"model": full_model_state(engine.model), "engine": engine.state_dict()}, path)


def test_engine_state_is_keyed_by_parameter_name_and_round_trips(tmp_path: Path) -> None:
    single_checkpoint(tmp_path / "single.pt")
    state = torch.load(tmp_path / "single.pt", weights_only=False)
    optim = state["engine"]["optimizer"]
    name = "lm.model.layers.0.self_attn.q_proj.weight"
    assert name in optim["state"] and name in state["model"]
    assert optim["state"][name]["exp_avg"].shape == (32, 32)  # whole, not a shard
    # decay group (matrices) then no-decay group (1-D): names, not indices
    assert name in optim["param_groups"][0]["params"]
    assert state["engine"]["global_step"] == 2
    resumed = worker.resume(tmp_path / "single.pt", SingleStrategy("cpu"))
    again = TrainEngine(make_model(), OPTIM)
    assert run_steps(again, None, 4)[2:] == pytest.approx(run_steps(resumed, None, 2), rel=1e-6)


@pytest.mark.slow
def test_checkpoints_resume_at_another_world_size(tmp_path: Path) -> None:
    single_checkpoint(tmp_path / "single.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(Path(worker.__file__)), str(tmp_path), str(tmp_path / "single.pt")],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2
    reference = result["uninterrupted"]  # 4 steps at world 2
    assert reference[0] > reference[-1]  # it learns

    # (a) world 2 → world 1, here
    engine = worker.resume(tmp_path / "world2.pt", SingleStrategy("cpu"))
    resumed_world1 = run_steps(engine, None, 2)
    weights_world1 = full_model_state(engine.model)

    uninterrupted = torch.load(tmp_path / "weights_uninterrupted.pt")
    for name, losses in (
        ("resumed_world1", resumed_world1),
        ("resumed_world2", result["resumed_world2"]),  # (b) world 2 → world 2
        ("resumed_from_single", result["resumed_from_single"]),  # world 1 → world 2
    ):
        assert losses == pytest.approx(reference[2:], rel=1e-4), name
        weights = weights_world1 if name == "resumed_world1" else torch.load(tmp_path / f"weights_{name}.pt")
        assert relative_max_diff(uninterrupted, weights) <= 1e-5, name

    # CPU offload builds and steps (on CPU it moves nothing: same losses)
    assert result["offload"] == pytest.approx(reference[:2], rel=1e-6)
    assert result["offload_param_device"] == "cpu"


def test_full_model_state_loads_into_a_plain_module() -> None:
    a, b = make_model(seed=0), make_model(seed=1)
    load_full_model_state(b, full_model_state(a))
    wa, wb = a.state_dict(), b.state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
