"""Tensor parallelism of 2 on 2 gloo ranks (data-parallel size 1), the FSDP2 strategy:

torchrun --nproc_per_node 2 tests/verl_core/training/tp_worker.py OUT_DIR

1. SFT: fsdp_worker's STEPS steps on the whole batch, Qwen2 and Llama;
2. RL: one GRPO iteration (``ppo_iteration``) on test_ppo_iteration's hand-built batch.

torchrun --nproc_per_node 4 tests/verl_core/training/tp_worker.py OUT_DIR 2d: SFT (Qwen2) on a
2 × 2 mesh, each data-parallel rank on its Karmarkar–Karp shard.
Rank 0 writes OUT_DIR/result.json (losses, metrics) and OUT_DIR/weights_*.pt (final full weights).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.verl_core.training import fsdp_worker
from tests.verl_core.training import test_ppo_iteration as rl
from tests.verl_core.training.teardown import end_worker
from verl_core.models.packed import PackedCausalLM
from verl_core.training.distributed import FSDP2Strategy, full_model_state, init_distributed, rank_shard
from verl_core.training.engine import Strategy, TrainEngine
from verl_core.training.ppo import PPOModels


def sft(architecture: str, strategy: Strategy) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine = TrainEngine(fsdp_worker.make_model(architecture=architecture), fsdp_worker.OPTIM, strategy)
    lengths = [len(s) for s in fsdp_worker.batch()[0]]
    shard = rank_shard(lengths, strategy.dp_rank, strategy.dp_size)  # tp ranks: the same shard
    losses = fsdp_worker.run_steps(engine, shard, fsdp_worker.STEPS)
    return losses, full_model_state(engine.model)


def grpo(strategy: Strategy) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One GRPO iteration (data-parallel size 1: ppo_iteration reads it from the engine's strategy);
    the metrics and the final weights."""
    actor = PackedCausalLM(rl.tiny_lm())
    engine = TrainEngine(actor, rl.plain_optim(), strategy)
    result = rl.run(PPOModels(engine.model, engine), rl.make_spec())
    return result.metrics, full_model_state(engine.model)


def tp_strategy() -> FSDP2Strategy:
    return FSDP2Strategy("cpu", tp_size=2)


def main() -> None:
    out = Path(sys.argv[1])
    rank, world = init_distributed("cpu")
    result: dict[str, Any] = {"world_size": world}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    if sys.argv[2:] == ["2d"]:
        result["sft_qwen2"], weights["sft_qwen2"] = sft("qwen2", tp_strategy())
        finish(rank, out, result, weights)
        return
    for arch in ("qwen2", "llama"):
        result[f"sft_{arch}"], weights[f"sft_{arch}"] = sft(arch, tp_strategy())
    probe: nn.Module = fsdp_worker.make_model()
    FSDP2Strategy("cpu", tp_size=2).prepare(probe)
    q = probe.decoder_layers()[0].self_attn.q_proj.weight
    result["q_proj_placements"] = str(q.placements)
    result["q_proj_local_shape"] = list(q.to_local().shape)
    result["grpo"], weights["grpo"] = grpo(tp_strategy())
    finish(rank, out, result, weights)


def finish(rank: int, out: Path, result: dict[str, Any], weights: dict[str, dict[str, torch.Tensor]]) -> None:
    if rank == 0:
        for name, w in weights.items():
            torch.save(w, out / f"weights_{name}.pt")
        (out / "result.json").write_text(json.dumps(result))
    end_worker()  # exits: never a normal interpreter exit (teardown.py)


if __name__ == "__main__":
    main()
