"""Full-state checkpoints across world sizes, FSDP2 side (2 ranks, gloo):

torchrun --nproc_per_node 2 tests/verl_core/training/fsdp_checkpoint_worker.py OUT_DIR SINGLE_CKPT

1. an uninterrupted 4-step run; after step 2 it saves OUT_DIR/world2.pt (full model + engine state);
2. a fresh model (other init) resumes from world2.pt and takes steps 3-4;
3. another resumes from SINGLE_CKPT (saved by one process after step 2) and takes steps 3-4;
4. 2 steps with CPU offload (FSDP2's CPUOffloadPolicy).
Rank 0 writes OUT_DIR/result.json (losses) and OUT_DIR/weights_*.pt (final full weights).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.verl_core.training.fsdp_worker import OPTIM, batch, make_model, run_steps
from tests.verl_core.training.teardown import end_worker
from verl_core.training.distributed import (
    FSDP2Strategy,
    full_model_state,
    init_distributed,
    load_full_model_state,
    rank_shard,
)
from verl_core.training.engine import Strategy, TrainEngine


def save_checkpoint(engine: TrainEngine, path: Path) -> None:
    """Every rank gathers; rank 0 writes."""
    state = {"model": full_model_state(engine.model), "engine": engine.state_dict()}
    if engine.rank == 0:
        torch.save(state, path)


def resume(path: Path, strategy: Strategy) -> TrainEngine:
    """A model initialised differently, then the checkpoint's weights and optimizer state."""
    state: dict[str, Any] = torch.load(path, weights_only=False)
    engine = TrainEngine(make_model(seed=7), OPTIM, strategy)
    load_full_model_state(engine.model, state["model"])
    engine.load_state_dict(state["engine"])
    return engine


def main() -> None:
    out, single_ckpt = Path(sys.argv[1]), Path(sys.argv[2])
    rank, world = init_distributed("cpu")
    shard = rank_shard([len(s) for s in batch()[0]], rank, world)
    result: dict[str, Any] = {"world_size": world}

    engine = TrainEngine(make_model(), OPTIM, FSDP2Strategy("cpu"))
    result["uninterrupted"] = run_steps(engine, shard, 2)
    save_checkpoint(engine, out / "world2.pt")
    result["uninterrupted"] += run_steps(engine, shard, 2)
    weights = {"uninterrupted": full_model_state(engine.model)}
    dist.barrier()  # world2.pt is written

    for name, path in (("resumed_world2", out / "world2.pt"), ("resumed_from_single", single_ckpt)):
        engine = resume(path, FSDP2Strategy("cpu"))
        assert engine.global_step == 2
        result[name] = run_steps(engine, shard, 2)
        weights[name] = full_model_state(engine.model)

    engine = TrainEngine(make_model(), OPTIM, FSDP2Strategy("cpu", param_offload=True))
    result["offload"] = run_steps(engine, shard, 2)
    result["offload_param_device"] = str(next(engine.model.parameters()).device)

    if rank == 0:
        for name, w in weights.items():
            torch.save(w, out / f"weights_{name}.pt")
        (out / "result.json").write_text(json.dumps(result))
    end_worker()  # exits: never a normal interpreter exit (teardown.py)


if __name__ == "__main__":
    main()
