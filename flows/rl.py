"""The RL iteration loop: rollout → reward → ppo_update, × ``trainer.total_iterations``, with
validation and checkpoints. One flow run, so in local mode the policy, reference and critic stay
in memory across iterations (artifacts are still written for every stage).

Resume (``trainer.resume_mode``): the loop starts after the last committed checkpoint; iterations
whose rollout/reward artifacts are committed are not sampled again (same seeds → same data).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger, task

from stages.ppo_update import ppo_update
from stages.reward import reward
from stages.rl_state import drop_state, get_state, init_state, save_checkpoint
from stages.rollout import rollout
from stages.validate import validate
from verl_core.config import VerlFlowConfig
from verl_core.run import RunContext


@task(name="init_rl_state")
def init_rl_state(ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None) -> int:
    return init_state(ctx, cfg, template_pack_uri, sft_uri)


@task(name="checkpoint")
def checkpoint(ctx: RunContext, cfg: VerlFlowConfig, iteration: int) -> str:
    return save_checkpoint(ctx, cfg, iteration)


@flow(name="rl-loop", log_prints=True)
def rl_loop(
    ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None
) -> dict[str, Any]:
    """Run the RL iterations; returns the final checkpoint URI, validation accuracies and timings."""
    logger = get_run_logger()
    t = cfg.trainer
    io_retry: dict[str, Any] = {
        "retries": cfg.execution.task_retries,
        "retry_delay_seconds": cfg.execution.retry_delay_s,
    }
    start = init_rl_state(ctx, cfg, template_pack_uri, sft_uri)
    lineage = get_state(ctx).lineage
    # trainer.total_epochs caps the iterations: each takes data.train_batch_size prompts
    n_prompts = int(ctx.store().read_manifest(template_pack_uri).summary["rows"]["prompts_train"])
    total = min(t.total_iterations, math.ceil(t.total_epochs * n_prompts / cfg.data.train_batch_size))
    val: dict[int, float] = {}
    timings = {"rollout": 0.0, "reward": 0.0, "update": 0.0, "validate": 0.0}
    try:
        if t.val_before_train and start == 0 and t.test_freq:
            with _timer(timings, "validate"):
                val[0] = validate(ctx, cfg, template_pack_uri, 0)
        last_ckpt = None
        for it in range(start, total):
            with _timer(timings, "rollout"):
                r = rollout(ctx, cfg.data, cfg.rollout, template_pack_uri, it, lineage)
            with _timer(timings, "reward"):
                w = reward.with_options(**io_retry)(ctx, cfg.reward, r, it, cfg.data.max_response_length)
            with _timer(timings, "update"):
                ppo_update(ctx, cfg, r, w, it)
            done = it + 1
            if t.test_freq and (done % t.test_freq == 0 or done == total):
                with _timer(timings, "validate"):
                    val[done] = validate(ctx, cfg, template_pack_uri, done)
            if done == total or (t.save_freq and done % t.save_freq == 0):
                last_ckpt = checkpoint(ctx, cfg, done)
            acc = f", val accuracy {val[done]:.3f}" if done in val else ""
            logger.info("rl: iteration %d/%d done%s", done, total, acc)
        if last_ckpt is None:  # nothing left to run: the final checkpoint is already committed
            last_ckpt = ctx.store().manifest_uri(ctx.run_id, f"ckpt/iter-{total:04d}")
        for m in ctx.store().list_manifests(ctx.run_id):  # validations of earlier (resumed) runs
            if m.stage.endswith("/val") and m.summary.get("iteration_lineage", lineage) == lineage:
                val.setdefault(int(m.stage[len("iter-") : -len("/val")]), float(m.summary["accuracy"]))
    finally:
        drop_state(ctx.run_id)
    return {"checkpoint": last_ckpt, "val_accuracy": val, "timing_s": timings}


@contextmanager
def _timer(into: dict[str, float], name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[name] += time.perf_counter() - t0
