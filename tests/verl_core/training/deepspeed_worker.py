"""ZeRO-2 run of the same tiny training as fsdp_worker (torchrun --nproc_per_node 2 ... OUT.json)."""

from __future__ import annotations

import json
import sys

from tests.verl_core.training.fsdp_worker import STEPS, batch
from verl_core.data.packing import pack
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM
from verl_core.training.deepspeed_engine import DeepSpeedTrainEngine
from verl_core.training.distributed import rank_shard
from verl_core.training.engine import OptimSpec
from verl_core.training.sft import count_loss_tokens, sft_loss


def main() -> None:
    import torch.distributed as dist

    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 64)
    model = init_causal_lm(scratch_config(spec, 64, eos_token_id=0, pad_token_id=0), seed=0)
    optim = OptimSpec(
        lr=1e-2, weight_decay=0.01, warmup_steps=1, total_steps=STEPS, scheduler="cosine", grad_clip=1.0
    )
    engine = DeepSpeedTrainEngine(PackedCausalLM(model), optim, zero_stage=2)
    seqs, masks = batch()
    n_tokens = count_loss_tokens(masks)
    idx = rank_shard([len(s) for s in seqs], dist.get_rank(), dist.get_world_size())
    micro = [
        pack([seqs[i] for i in part], loss_masks=[masks[i] for i in part]) for part in (idx[::2], idx[1::2])
    ]
    losses = []
    for _ in range(STEPS):
        stats = engine.step(
            micro,
            lambda mb: sft_loss(
                engine.model, mb.input_ids, mb.cu_seqlens, mb.loss_mask, num_loss_tokens=n_tokens
            )[0],  # type: ignore[arg-type]
        )
        losses.append(stats.loss)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"losses": losses}, f)


if __name__ == "__main__":
    main()
