"""ZeRO-2 run of the same tiny training as fsdp_worker (torchrun --nproc_per_node 2 ... OUT.json)."""

from __future__ import annotations

import json
import sys

from torch import nn

from tests.verl_core.training.fsdp_worker import batch, train
from verl_core.training.deepspeed_engine import DeepSpeedTrainEngine
from verl_core.training.distributed import init_distributed, rank_shard
from verl_core.training.engine import OptimSpec


def make_engine(model: nn.Module, optim: OptimSpec) -> DeepSpeedTrainEngine:
    return DeepSpeedTrainEngine(model, optim, zero_stage=2)


def main() -> None:
    rank, world = init_distributed("cpu")  # DeepSpeed reuses the initialised process group
    seqs, _ = batch()
    losses = train(make_engine, rank_shard([len(s) for s in seqs], rank, world))
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"losses": losses}, f)


if __name__ == "__main__":
    main()
