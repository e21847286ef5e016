"""DeepSpeed runs of the tiny training of fsdp_worker, all in one torchrun launch (each launch costs
~15-20 s of imports here):

    torchrun --nproc_per_node 2 tests/verl_core/training/deepspeed_worker.py OUT.json

For ZeRO 1, 2 and 3: the losses of STEPS steps; for ZeRO 2 and 3 also a checkpoint after
``SAVE_AT`` steps (the full model through ``full_state_dict``, the trainer state through
``state_dict`` → bytes) loaded into a fresh model and engine, then the remaining steps' losses, and
the gathered weights at the end; LoRA under ZeRO-3 (frozen base, adapters only in the optimizer).
Rank 0 writes everything to OUT.json.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.verl_core.training.fsdp_worker import OPTIM, STEPS, batch
from tests.verl_core.training.teardown import end_worker
from verl_core.data.packing import pack
from verl_core.errors import ConfigError
from verl_core.models.checkpoint import load_state_bytes, state_bytes
from verl_core.models.loading import ScratchSpec, apply_lora, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM
from verl_core.training.deepspeed_engine import DeepSpeedTrainEngine
from verl_core.training.distributed import init_distributed, rank_shard
from verl_core.training.sft import count_loss_tokens, sft_loss

SAVE_AT = 2
STAGES = (1, 2, 3)
RESUMED_STAGES = (2, 3)


def tiny_model(seed: int = 0) -> nn.Module:
    """fsdp_worker's model (seed 0 is the one its single-process reference trains)."""
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 64)
    return init_causal_lm(scratch_config(spec, 64, eos_token_id=0, pad_token_id=0), seed=seed)


def train_steps(engine: Any, shard: list[int], steps: int) -> list[float]:
    """fsdp_worker.train's loop: ``steps`` optimizer steps on this rank's shard, two micro-batches."""
    seqs, masks = batch()
    n_tokens = count_loss_tokens(masks)  # global normaliser, all ranks
    halves = (shard[::2], shard[1::2])
    micro = [pack([seqs[i] for i in part], loss_masks=[masks[i] for i in part]) for part in halves]
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


def engine_for(stage: int, model: nn.Module | None = None) -> DeepSpeedTrainEngine:
    return DeepSpeedTrainEngine(model or PackedCausalLM(tiny_model()), OPTIM, zero_stage=stage)


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's bytes on every rank (as a stage would: rank 0 writes, every rank reads)."""
    box = [data]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def resumed(stage: int, shard: list[int], uninterrupted: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Train SAVE_AT steps, checkpoint, rebuild from the checkpoint alone, train the rest; compare the
    final weights with the ``uninterrupted`` run's (rank 0)."""
    first = engine_for(stage)
    losses = train_steps(first, shard, SAVE_AT)
    weights = first.full_state_dict()  # rank 0 only
    trainer = first.state_dict()
    blob = broadcast_bytes(state_bytes({"weights": weights, "trainer": trainer}) if first.rank == 0 else None)
    del first
    state = load_state_bytes(blob, "test checkpoint")
    model = PackedCausalLM(tiny_model(seed=1))  # other initial weights: all must come from the checkpoint
    model.load_state_dict(state["weights"])
    second = engine_for(stage, model)
    second.load_state_dict(state["trainer"])
    assert second.global_step == SAVE_AT
    losses += train_steps(second, shard, STEPS - SAVE_AT)
    final = second.full_state_dict()
    other_world = {**state["trainer"], "world_size": 1}
    try:
        second.load_state_dict(other_world)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return {
        "losses": losses,
        "max_abs_diff": max((final[k] - v).abs().max().item() for k, v in uninterrupted.items())
        if second.rank == 0
        else None,
        "same_keys": sorted(final) == sorted(uninterrupted),
        "state_files": sorted(trainer["files"]),
        "other_world_size_error": refused,
    }


def lora_model() -> nn.Module:
    """The tiny model with all-linear LoRA adapters. LoRA's A matrices are random: every rank must
    draw the same ones (ZeRO-3, like FSDP2, keeps each rank's own slice and broadcasts nothing)."""
    torch.manual_seed(0)
    return PackedCausalLM(apply_lora(tiny_model(), rank=4, alpha=8, dropout=0.0, target_modules="all-linear"))


def lora(stage: int, shard: list[int]) -> dict[str, Any]:
    """LoRA under ZeRO-``stage``: the losses and which gathered weights moved in SAVE_AT steps."""
    model = lora_model()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = engine_for(stage, model)
    losses = train_steps(engine, shard, SAVE_AT)
    final = engine.full_state_dict()
    moved = sorted(k for k in final if not torch.equal(final[k], start[k]))
    return {"losses": losses, "same_keys": sorted(final) == sorted(start), "moved": moved}


def main() -> None:
    rank, world = init_distributed("cpu")  # DeepSpeed reuses the initialised process group
    seqs, _ = batch()
    shard = rank_shard([len(s) for s in seqs], rank, world)
    out: dict[str, Any] = {"world_size": world}
    finals = {}
    for stage in STAGES:
        engine = engine_for(stage)
        assert (engine.dp_rank, engine.dp_size) == (rank, world)
        out[f"zero{stage}"] = {"losses": train_steps(engine, shard, STEPS)}
        finals[stage] = engine.full_state_dict()
        out[f"zero{stage}"]["n_params"] = sum(v.numel() for v in finals[stage].values())
    for stage in RESUMED_STAGES:
        out[f"zero{stage}_resumed"] = resumed(stage, shard, finals[stage])
    out["zero3_lora"] = lora(3, shard)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    end_worker()  # exits: never a normal interpreter exit (teardown.py)


if __name__ == "__main__":
    main()
