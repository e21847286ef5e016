"""FSDP2 with a bf16 ``MixedPrecisionPolicy`` under torchrun (2 gloo ranks): the sharded master
parameters and the optimizer state stay fp32, the decoder computes in bf16.

torchrun --nproc_per_node 2 tests/verl_core/training/mixprec_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from tests.verl_core.training.fsdp_worker import OPTIM, batch, make_model, run_steps
from tests.verl_core.training.teardown import end_worker
from verl_core.training.distributed import FSDP2Strategy, decoder_layers, init_distributed, rank_shard
from verl_core.training.engine import TrainEngine
from verl_core.training.precision import MixedPrecision

STEPS = 2


def main() -> None:
    rank, world = init_distributed("cpu")
    seqs, _ = batch()
    model = make_model()
    seen: list[str] = []  # dtype of the first decoder layer's MLP output, every forward
    mlp = decoder_layers(model)[0].mlp
    mlp.register_forward_hook(lambda _m, _a, out: seen.append(str(out.dtype)))
    engine = TrainEngine(model, OPTIM, FSDP2Strategy("cpu", mixed_precision=MixedPrecision()))
    losses = run_steps(engine, rank_shard([len(s) for s in seqs], rank, world), STEPS)
    params = sorted({str(p.dtype) for p in engine.model.parameters()})
    moments = sorted({str(s["exp_avg"].dtype) for s in engine.optimizer.state.values()})
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            result = {"losses": losses, "params": params, "moments": moments, "mlp_out": sorted(set(seen))}
            json.dump(result, f)
    end_worker()  # exits: never a normal interpreter exit (teardown.py)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
