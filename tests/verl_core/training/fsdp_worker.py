"""A tiny training run used to compare strategies: single process vs FSDP2 under torchrun.

torchrun --nproc_per_node 2 tests/verl_core/training/fsdp_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tests.verl_core.training.teardown import end_worker
from verl_core.data.packing import PackedBatch, pack
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM
from verl_core.training.engine import OptimSpec, SingleStrategy, Strategy, TrainEngine
from verl_core.training.sft import count_loss_tokens, sft_loss

STEPS = 4


def batch() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 12, 5, 9, 4, 6, 10]
    seqs = [torch.randint(1, 60, (n,), generator=g).tolist() for n in lengths]
    masks = [[0, 0] + [1] * (n - 2) for n in lengths]
    return seqs, masks


OPTIM = OptimSpec(
    lr=1e-2, weight_decay=0.01, warmup_steps=1, total_steps=STEPS, scheduler="cosine", grad_clip=1.0
)


def with_strategy(strategy: Strategy) -> Callable[[nn.Module, OptimSpec], Any]:
    """An engine factory for :func:`train`: our TrainEngine on ``strategy``."""
    return lambda model, optim: TrainEngine(model, optim, strategy)


def make_model(seed: int = 0, architecture: str = "qwen2") -> PackedCausalLM:
    """4 query heads, 2 key/value heads (GQA), 2 layers: tensor parallelism of 2 divides everything."""
    spec = ScratchSpec(architecture, 32, 2, 4, 2, 64, 64)
    return PackedCausalLM(init_causal_lm(scratch_config(spec, 64, eos_token_id=0, pad_token_id=0), seed=seed))


def run_steps(engine: Any, shard: list[int] | None, steps: int) -> list[float]:
    """``steps`` optimizer steps of SFT on the fixed batch (this rank's ``shard`` of it); the losses."""
    seqs, masks = batch()
    n_tokens = count_loss_tokens(masks)  # global normaliser, all ranks
    idx = shard if shard is not None else list(range(len(seqs)))
    # two micro-batches per rank
    micro: list[PackedBatch] = [
        pack([seqs[i] for i in part], loss_masks=[masks[i] for i in part]) for part in (idx[::2], idx[1::2])
    ]
    losses = []
    for _ in range(steps):
        stats = engine.step(
            micro,
            lambda mb: sft_loss(
                engine.model, mb.input_ids, mb.cu_seqlens, mb.loss_mask, num_loss_tokens=n_tokens
            )[0],
        )
        losses.append(stats.loss)
    return losses


def train(make_engine: Callable[[nn.Module, OptimSpec], Any], shard: list[int] | None = None) -> list[float]:
    """STEPS optimizer steps of SFT on a fixed batch (this rank's ``shard`` of it); the losses."""
    return run_steps(make_engine(make_model(), OPTIM), shard, STEPS)


def main() -> None:

    from verl_core.training.distributed import FSDP2Strategy, init_distributed, rank_shard

    rank, world = init_distributed("cpu")
    seqs, _ = batch()
    losses = train(with_strategy(FSDP2Strategy("cpu")), rank_shard([len(s) for s in seqs], rank, world))
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"losses": losses, "world_size": world}, f)
    end_worker()  # exits: never a normal interpreter exit (teardown.py)


def single() -> list[float]:
    return train(with_strategy(SingleStrategy("cpu")))


if __name__ == "__main__":
    main()
