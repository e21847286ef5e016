"""SFT warm-up stage: next-token loss on assistant tokens, packed micro-batches, periodic validation,
checkpoints through the artifact store, resume from the last checkpoint.

Reads the template_pack stage (tokenizer files, ``sft_tokens/{train,val}.parquet``); writes the policy
checkpoint under ``policy/`` (see :mod:`stages.floor.artifacts`), ``metrics.parquet`` and ``report.json``.
While it runs, a checkpoint (weights + optimizer/scheduler/RNG state + step) is committed every
``sft.save_every`` steps as the stage ``sft-ckpt``; a rerun of the same run with the same inputs
continues from it and ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist
from prefect import task

from stages.floor.artifacts import load_tokenizer, read_policy, write_policy
from stages.floor.builders import build_policy, mixed_precision
from stages.floor.locations import SFT, SFT_CKPT
from stages.floor.logging import progress, stage_logger
from verl_core.config import ActorConfig, ModelConfig, SFTConfig, TrainerConfig
from verl_core.data.packing import PackedBatch, pack
from verl_core.errors import DataError
from verl_core.models.checkpoint import load_state_bytes, rng_state, set_rng_state, state_bytes
from verl_core.models.loading import count_parameters, resolve_device
from verl_core.models.packed import PackedCausalLM
from verl_core.runtime.ranks import broadcast_from_main, is_main, on_main, rank0_to_main
from verl_core.runtime.run import RunContext
from verl_core.runtime.run_length import StepCount, check_completed
from verl_core.seeding import derive_seed
from verl_core.store import ArtifactStore, Manifest
from verl_core.training.data_parallel import dp_view
from verl_core.training.engine import OptimSpec
from verl_core.training.sft import sft_loss, sft_step_plan
from verl_core.training.strategies import build_train_engine, full_weights

CKPT_STAGE = SFT_CKPT


@task(name="sft_warmup")
def sft_warmup(
    ctx: RunContext,
    model: ModelConfig,
    sft: SFTConfig,
    trainer: TrainerConfig,
    template_pack_uri: str,
    actor: ActorConfig | None = None,
) -> str:
    """Fine-tune the initial policy on the SFT split; returns the stage's manifest URI. ``actor``: how
    the policy trains (``actor.strategy``, …: one rank of an SPMD job; None: one process). The
    strategy does not change the result, so it is not part of the stage's inputs."""
    log = stage_logger(__name__)
    store = ctx.store()
    # 1. Skip when committed with the same inputs
    params = {
        "model": model.model_dump(mode="json"),
        "sft": sft.model_dump(mode="json"),
        "seed": trainer.seed,
    }
    stage = store.open_stage(ctx.run_id, SFT, params=params, inputs={"template_pack": template_pack_uri})
    if broadcast_from_main(stage.done):  # rank 0 decides for every rank of an SPMD job
        log.info("sft: committed with the same inputs, skipped")
        return stage.manifest_uri

    # 2. Data and tokenizer
    tp = store.read_manifest(template_pack_uri)
    tokenizer = load_tokenizer(store, template_pack_uri)
    train = _rows(store, tp, "sft_tokens/train.parquet")
    val = _rows(store, tp, "sft_tokens/val.parquet")
    if not train[0]:
        raise DataError(f"{store.file_uri(tp, 'sft_tokens/train.parquet')}: no SFT rows to train on")

    # 3. Model, engine, schedule
    torch.manual_seed(trainer.seed)
    device = resolve_device(trainer.device)
    lm = build_policy(model, tokenizer, seed=trainer.seed)
    steps_per_epoch = math.ceil(len(train[0]) / sft.batch_size)
    requested = sft.max_steps or sft.epochs * steps_per_epoch
    total = min(requested, sft.epochs * steps_per_epoch)
    spec = OptimSpec(
        lr=sft.lr,
        weight_decay=sft.weight_decay,
        warmup_steps=int(sft.warmup_ratio * total),
        total_steps=total,
        scheduler=sft.lr_scheduler,
        grad_clip=sft.grad_clip,
    )

    # 4. Resume from the last checkpoint of this very stage input, if any
    ckpt = store.committed(ctx.run_id, CKPT_STAGE)
    if ckpt is not None and ckpt.summary.get("sft_key") == stage.input_key:
        lm = read_policy(store, ckpt, "policy", model)
    a = actor or ActorConfig()
    packed = PackedCausalLM(lm, attention=model.packed_attention, compile_layers=model.torch_compile)
    engine = build_train_engine(
        packed, spec, strategy=a.strategy, device=device, zero_stage=a.zero_stage,
        param_offload=a.param_offload, tp_size=a.tensor_parallel_size,
        mixed_precision=mixed_precision(a.mixed_precision),
    )  # fmt: skip
    start = 0
    history: list[tuple[int, str, float]] = []
    if ckpt is not None and ckpt.summary.get("sft_key") == stage.input_key:
        state = load_state_bytes(
            store.read_bytes(ckpt, "trainer_state.pt"), store.file_uri(ckpt, "trainer_state.pt")
        )
        engine.load_state_dict(state["engine"])
        set_rng_state(state["rng"])
        start = int(state["step"])
        history = [(int(a), str(b), float(c)) for a, b, c in state["history"]]
        log.info("sft: resumed from the checkpoint at step %d of %d", start, total)
    log.info(
        "sft: %d train / %d val rows, %d steps (%d per epoch), %.2fM trainable of %.2fM params, device %s",
        len(train[0]), len(val[0]), total, steps_per_epoch,
        count_parameters(lm, True) / 1e6, count_parameters(lm) / 1e6, device,
    )  # fmt: skip

    # 5. Train
    tracker = ctx.tracker()
    tokens, t0 = 0, time.perf_counter()
    if start == 0:
        history.append((0, "sft/val_loss", _val_loss(engine, val, sft.max_token_len_per_batch, device)))
    completed = start
    with progress("sft", total, completed=start) as advance:
        for step in range(start, total):
            rows = _batch_rows(len(train[0]), sft.batch_size, step, steps_per_epoch, trainer.seed)
            if not rows:  # the loader ran out before the plan: the step count check below fails the stage
                break
            micro, n_loss = _micro_batches(engine, train, rows, sft.max_token_len_per_batch, device)
            stats = engine.step(micro, _loss_fn(engine, n_loss), where="sft")
            tokens += sum(mb.num_tokens for mb, weight in micro if weight)  # this rank's, padding not
            metrics = {"sft/loss": stats.loss, "sft/grad_norm": stats.grad_norm, "sft/lr": stats.lr}
            done = completed = step + 1
            if sft.val_every and done % sft.val_every == 0 and done < total:
                metrics["sft/val_loss"] = _val_loss(engine, val, sft.max_token_len_per_batch, device)
            if done % sft.log_every == 0 or done == total:
                metrics["perf/sft_tokens_per_s"] = tokens / max(1e-9, time.perf_counter() - t0)
                tracker.log_metrics(metrics, step=done)
                log.info("sft: step %d/%d %s", done, total, _fmt(metrics))
            history.extend((done, k, float(v)) for k, v in metrics.items())
            if sft.save_every and done % sft.save_every == 0 and done < total:
                _save_checkpoint(
                    store, ctx.run_id, stage.input_key, engine, lm, tokenizer, model, done, history
                )
            advance(1, status=f"loss {stats.loss:.4f}")

    # 6. Every planned step done (nothing under-trained is committed), final validation, files, commit
    cap = f"sft.epochs={sft.epochs} over {len(train[0])} rows" if total < requested else None
    count = StepCount(
        unit="SFT optimizer steps", requested=requested, planned=total, completed=completed, cap=cap
    )
    check_completed("sft", count)
    final_val = _val_loss(engine, val, sft.max_token_len_per_batch, device)
    tracker.log_metrics({"sft/val_loss": final_val}, step=total)
    history.append((total, "sft/val_loss", final_val))
    weights = full_weights(engine, "lm.")  # every rank (gathered to rank 0 when sharded)
    if not is_main():  # the other ranks of an SPMD job: rank 0 commits, everyone returns its URI
        return broadcast_from_main("")
    write_policy(stage, "policy", lm, tokenizer, model, state_dict=weights)
    stage.write_table("metrics.parquet", _metrics_table(history), "metrics")
    first_val = next((v for s, k, v in history if k == "sft/val_loss"), final_val)
    report = {
        "steps": completed,
        "step_count": count.model_dump(mode="json"),
        "train_rows": len(train[0]),
        "val_rows": len(val[0]),
        "first_val_loss": first_val,
        "final_val_loss": final_val,
        "trainable_params": count_parameters(lm, True),
    }
    stage.write_json("report.json", report)  # deterministic: a rerun writes the same bytes
    # the training loop's seconds in this attempt (its validation losses included; a resumed attempt
    # counts from its checkpoint), in the manifest's summary only: what an SFT-only control of the
    # same cost is sized by (benchmarks/learning.py)
    uri = stage.commit(summary={**report, "train_seconds": time.perf_counter() - t0})
    log.info("sft: done, val loss %.4f", final_val)
    return broadcast_from_main(uri)


Micro = tuple[PackedBatch, float]  # a packed micro-batch and its loss weight (0: padding, see below)


def _loss_fn(engine: Any, num_loss_tokens: int) -> Callable[[Micro], torch.Tensor]:
    """The micro-batch loss: its share of the step's token-mean NLL (all ranks), times its weight."""
    model = engine.model

    def loss(micro: Micro) -> torch.Tensor:
        mb, weight = micro
        assert mb.loss_mask is not None
        nll = sft_loss(model, mb.input_ids, mb.cu_seqlens, mb.loss_mask, num_loss_tokens=num_loss_tokens)[0]
        return nll * weight

    return loss


def _rows(store: ArtifactStore, manifest: Manifest, name: str) -> tuple[list[list[int]], list[list[int]]]:
    table = store.read_table(manifest, name, columns=["input_ids", "loss_mask"])
    return table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()


def _batch_rows(n: int, batch_size: int, step: int, steps_per_epoch: int, seed: int) -> list[int]:
    """Rows of optimizer step ``step``: a permutation per epoch seeded by (seed, epoch), so the order
    depends only on the step (a resumed run sees exactly the same batches)."""
    epoch, k = divmod(step, steps_per_epoch)
    g = torch.Generator().manual_seed(derive_seed("sft_order", seed, epoch))
    order = torch.randperm(n, generator=g).tolist()
    return order[k * batch_size : (k + 1) * batch_size]


def _micro_batches(
    engine: Any,
    data: tuple[list[list[int]], list[list[int]]],
    rows: Sequence[int],
    budget: int,
    device: torch.device,
) -> tuple[list[Micro], int]:
    """This rank's packed micro-batches of the step ``rows`` (its data-parallel share, padded to the
    count every rank runs: a padding micro-batch has weight 0) and the step's loss-token count."""
    ids, masks = data
    plan = sft_step_plan(rows, [len(x) for x in ids], masks, budget, dp_view(engine))
    micro = [
        (
            pack([ids[r] for r in mb.rows], seq_index=mb.rows, loss_masks=[masks[r] for r in mb.rows]).to(
                device
            ),
            mb.weight,
        )
        for mb in plan.micro_batches
    ]
    return micro, plan.num_loss_tokens


@torch.no_grad()
def _val_loss(
    engine: Any, val: tuple[list[list[int]], list[list[int]]], budget: int, device: torch.device
) -> float:
    """Token-mean NLL over the whole validation split (each rank its share, summed over ranks)."""
    if not val[0]:
        return float("nan")
    engine.model.eval()
    micro, n_loss = _micro_batches(engine, val, list(range(len(val[0]))), budget, device)
    loss = _loss_fn(engine, n_loss)
    total = torch.tensor([sum(float(loss(mb)) for mb in micro)], dtype=torch.float64)
    group = dp_view(engine).group
    if group is not None:
        dist.all_reduce(total, group=group)
    return float(total)


def _save_checkpoint(
    store: ArtifactStore,
    run_id: str,
    sft_key: str,
    engine: Any,
    lm: torch.nn.Module,
    tokenizer: Any,
    model: ModelConfig,
    step: int,
    history: list[tuple[int, str, float]],
) -> None:
    weights = full_weights(engine, "lm.")  # every rank: collectives when sharded
    optimizer = rank0_to_main(engine.state_dict())  # every rank: the full state lands on global rank 0
    trainer_state = {"engine": optimizer, "rng": rng_state(), "step": step, "history": history}

    def commit() -> None:
        ckpt = store.open_stage(run_id, CKPT_STAGE, params={"sft_key": sft_key, "step": step})
        write_policy(ckpt, "policy", lm, tokenizer, model, state_dict=weights)
        ckpt.write_bytes("trainer_state.pt", state_bytes(trainer_state))
        ckpt.commit(summary={"sft_key": sft_key, "step": step})

    on_main(commit)


def _metrics_table(history: list[tuple[int, str, float]]) -> pa.Table:
    steps, names, values = zip(*history, strict=True) if history else ((), (), ())
    return pa.table(
        {"step": pa.array(steps, pa.int64()), "name": list(names), "value": pa.array(values, pa.float64())}
    )


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items())
