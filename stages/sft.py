"""SFT warm-up stage: the loop of :func:`verl_core.training.sft.sft_train` (next-token loss on assistant
tokens, packed micro-batches, periodic validation) with checkpoints through the artifact store, resumed
from the last checkpoint.

Reads the template_pack stage (tokenizer files, ``sft_tokens/{train,val}.parquet``); writes the policy
checkpoint under ``policy/`` (see :mod:`stages.floor.artifacts`), ``metrics.parquet`` and ``report.json``.
While it runs, a checkpoint (weights + optimizer/scheduler/RNG state + step) is committed every
``sft.save_every`` steps as the stage ``sft-ckpt``; a rerun of the same run with the same inputs
continues from it and ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pyarrow as pa
import torch
from prefect import task

from stages.floor.artifacts import load_tokenizer, read_policy, write_policy
from stages.floor.commit import commit_once, committed
from stages.floor.locations import SFT, SFT_CKPT
from stages.floor.logging import progress, stage_logger
from stages.floor.policy import build_policy, mixed_precision
from stages.floor.specs import optim_spec
from verl_core.config import ActorConfig, ModelConfig, SFTConfig, TrainerConfig
from verl_core.errors import DataError
from verl_core.models.checkpoint import load_state, save_state, seed_rngs
from verl_core.models.loading import count_parameters, resolve_device
from verl_core.models.packed import PackedCausalLM
from verl_core.runtime.run import RunContext
from verl_core.runtime.run_length import StepCount, check_completed
from verl_core.store import ArtifactStore, Manifest, StageWriter
from verl_core.training.sft import History, Rows, SFTCheckpoint, SFTLoopSpec, resume, sft_train, val_loss
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
    the policy trains (``actor.strategy``, …: one process of an SPMD job; None: alone). The
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
    if committed(stage):
        log.info("sft: committed with the same inputs, skipped")
        return stage.manifest_uri

    # 2. Data and tokenizer
    tp = store.read_manifest(template_pack_uri)
    tokenizer = load_tokenizer(store, template_pack_uri)
    train = _rows(store, tp, "sft_tokens/train.parquet")
    val = _rows(store, tp, "sft_tokens/val.parquet")
    if not train[0]:
        raise DataError(f"{store.file_uri(tp, 'sft_tokens/train.parquet')}: no SFT rows to train on")

    # 3. Model and engine, from the last checkpoint of this very stage input if any
    seed_rngs(trainer.seed)
    device = resolve_device(trainer.device)
    lm = build_policy(model, tokenizer, seed=trainer.seed)
    spec, requested = _loop_spec(sft, trainer, len(train[0]))
    ckpt = _own_checkpoint(store, ctx.run_id, stage.input_key)
    if ckpt is not None:
        lm = read_policy(store, ckpt, "policy", model)
    engine = _engine(lm, model, sft, spec.total_steps, actor or ActorConfig(), device)
    start, history = 0, []
    if ckpt is not None:
        start, history = resume(engine, _trainer_state(store, ckpt))
        log.info("sft: resumed from the checkpoint at step %d of %d", start, spec.total_steps)
    log.info(
        "sft: %d train / %d val rows, %d steps (%d per epoch), %.2fM trainable of %.2fM params, device %s",
        len(train[0]), len(val[0]), spec.total_steps, spec.steps_per_epoch,
        count_parameters(lm, True) / 1e6, count_parameters(lm) / 1e6, device,
    )  # fmt: skip

    # 4. Train (each checkpoint committed once: commit_once)
    tracker = ctx.tracker()

    def on_log(step: int, metrics: dict[str, float]) -> None:
        tracker.log_metrics(metrics, step=step)
        log.info("sft: step %d/%d %s", step, spec.total_steps, _fmt(metrics))

    def on_checkpoint(c: SFTCheckpoint) -> None:
        commit_once(lambda: _save_checkpoint(store, ctx.run_id, stage.input_key, c, lm, tokenizer, model))

    with progress("sft", spec.total_steps, completed=start) as advance:
        run = sft_train(
            engine, train, val, spec, device=device, start=start, history=history, on_log=on_log,
            on_checkpoint=on_checkpoint, on_step=lambda loss: advance(1, status=f"loss {loss:.4f}"),
        )  # fmt: skip

    # 5. Every planned step done (nothing under-trained is committed), final validation, files, commit
    count = _step_count(sft, spec, requested, run.completed, len(train[0]))
    check_completed("sft", count)
    final_val = val_loss(engine, val, spec.token_budget, device)
    tracker.log_metrics({"sft/val_loss": final_val}, step=spec.total_steps)
    run.history.append((spec.total_steps, "sft/val_loss", final_val))
    weights = full_weights(engine, "lm.")  # gathered when sharded
    report = _report(count, len(train[0]), len(val[0]), run.history, count_parameters(lm, True))
    return commit_once(
        lambda: _commit(stage, lm, tokenizer, model, weights, run.history, report, run.started)
    )


def _rows(store: ArtifactStore, manifest: Manifest, name: str) -> Rows:
    table = store.read_table(manifest, name, columns=["input_ids", "loss_mask"])
    return table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()


def _loop_spec(sft: SFTConfig, trainer: TrainerConfig, n_rows: int) -> tuple[SFTLoopSpec, int]:
    """The run's plan over ``n_rows`` training rows, and the steps requested (``sft.max_steps``, else
    the epochs'): the plan stops at ``sft.epochs`` passes over the rows."""
    steps_per_epoch = math.ceil(n_rows / sft.batch_size)
    requested = sft.max_steps or sft.epochs * steps_per_epoch
    spec = SFTLoopSpec(
        total_steps=min(requested, sft.epochs * steps_per_epoch),
        steps_per_epoch=steps_per_epoch,
        batch_size=sft.batch_size,
        token_budget=sft.max_token_len_per_batch,
        val_every=sft.val_every,
        log_every=sft.log_every,
        save_every=sft.save_every,
        seed=trainer.seed,
    )
    return spec, requested


def _own_checkpoint(store: ArtifactStore, run_id: str, sft_key: str) -> Manifest | None:
    """The run's last SFT checkpoint if it was made for this very stage input (``sft_key``)."""
    ckpt = store.committed(run_id, CKPT_STAGE)
    return ckpt if ckpt is not None and ckpt.summary.get("sft_key") == sft_key else None


def _step_count(sft: SFTConfig, spec: SFTLoopSpec, requested: int, completed: int, n_rows: int) -> StepCount:
    cap = f"sft.epochs={sft.epochs} over {n_rows} rows" if spec.total_steps < requested else None
    return StepCount(
        unit="SFT optimizer steps",
        requested=requested,
        planned=spec.total_steps,
        completed=completed,
        cap=cap,
    )


def _report(
    count: StepCount, train_rows: int, val_rows: int, history: History, trainable_params: int
) -> dict[str, Any]:
    """``report.json``: the step count, the split sizes, the first and the final validation loss
    (the history's last entry)."""
    final_val = history[-1][2]
    return {
        "steps": count.completed,
        "step_count": count.model_dump(mode="json"),
        "train_rows": train_rows,
        "val_rows": val_rows,
        "first_val_loss": next((v for s, k, v in history if k == "sft/val_loss"), final_val),
        "final_val_loss": final_val,
        "trainable_params": trainable_params,
    }


def _engine(
    lm: torch.nn.Module,
    model: ModelConfig,
    sft: SFTConfig,
    total_steps: int,
    a: ActorConfig,
    device: torch.device,
) -> Any:
    """The train engine of ``lm`` (packed) with ``sft``'s optimizer over ``total_steps`` steps, sharded
    as ``a`` says."""
    optim = optim_spec(
        lr=sft.lr, weight_decay=sft.weight_decay, grad_clip=sft.grad_clip, total_steps=total_steps,
        warmup_ratio=sft.warmup_ratio, scheduler=sft.lr_scheduler,
    )  # fmt: skip
    packed = PackedCausalLM(lm, attention=model.packed_attention, compile_layers=model.torch_compile)
    return build_train_engine(
        packed, optim, strategy=a.strategy, device=device, zero_stage=a.zero_stage,
        param_offload=a.param_offload, tp_size=a.tensor_parallel_size,
        mixed_precision=mixed_precision(a.mixed_precision),
    )  # fmt: skip


def _trainer_state(store: ArtifactStore, ckpt: Manifest) -> dict[str, Any]:
    with store.local_file(ckpt, "trainer_state.pt") as path:  # memory-mapped, not read whole
        return load_state(path, store.file_uri(ckpt, "trainer_state.pt"))


def _save_checkpoint(
    store: ArtifactStore,
    run_id: str,
    sft_key: str,
    c: SFTCheckpoint,
    lm: torch.nn.Module,
    tokenizer: Any,
    model: ModelConfig,
) -> None:
    """Commit checkpoint ``c`` as the stage ``sft-ckpt`` (the main rank)."""
    ckpt = store.open_stage(run_id, CKPT_STAGE, params={"sft_key": sft_key, "step": c.step})
    write_policy(ckpt, "policy", lm, tokenizer, model, state_dict=c.weights)
    with ckpt.staged_file("trainer_state.pt") as path:  # streamed, never one bytes object
        save_state(c.trainer_state, path)
    ckpt.commit(summary={"sft_key": sft_key, "step": c.step})


def _commit(
    stage: StageWriter,
    lm: torch.nn.Module,
    tokenizer: Any,
    model: ModelConfig,
    weights: dict[str, torch.Tensor] | None,
    history: History,
    report: dict[str, Any],
    started: float,
) -> str:
    """Write the policy, ``metrics.parquet`` and ``report.json``, commit (the main rank); the URI."""
    write_policy(stage, "policy", lm, tokenizer, model, state_dict=weights)
    stage.write_table("metrics.parquet", _metrics_table(history), "metrics")
    stage.write_json("report.json", report)  # deterministic: a rerun writes the same bytes
    # the training loop's seconds in this attempt (its validation losses included; a resumed attempt
    # counts from its checkpoint), in the manifest's summary only: what an SFT-only control of the
    # same cost is sized by (benchmarks/learning.py)
    uri = stage.commit(summary={**report, "train_seconds": time.perf_counter() - started})
    stage_logger(__name__).info("sft: done, val loss %.4f", report["final_val_loss"])
    return uri


def _metrics_table(history: History) -> pa.Table:
    steps, names, values = zip(*history, strict=True) if history else ((), (), ())
    return pa.table(
        {"step": pa.array(steps, pa.int64()), "name": list(names), "value": pa.array(values, pa.float64())}
    )


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items())
