"""Set-up shared by the RL benchmarks: a tiny run's config overrides, and its data (+ SFT) built by
the project's own stage functions."""

from __future__ import annotations

from pathlib import Path

from verl_core.config import VerlFlowConfig
from verl_core.runtime.run import RunContext


def base_overrides(root: Path, iterations: int, sft_steps: int) -> list[str]:
    """Local store under ``root``, no tracking, CPU, a fresh RL phase of ``iterations`` without
    validation or checkpoints, and ``sft_steps`` SFT steps (0: none)."""
    steps = max(sft_steps, 1)
    return [
        f"store.url={root / 'store'}",
        "tracking.enabled=false",
        "trainer.device=cpu",
        "trainer.resume_mode=disable",
        f"trainer.total_iterations={iterations}",
        "trainer.test_freq=0",
        "data.arithmetic_val_size=20",
        f"sft.enable={'true' if sft_steps else 'false'}",
        f"sft.max_steps={steps}",
        f"sft.save_every={steps}",
        "sft.val_every=0",
    ]


def build_inputs(cfg: VerlFlowConfig, run_id: str = "setup") -> tuple[RunContext, str, str | None]:
    """Run preprocess, template_pack and (if enabled) SFT: ``(ctx, template_pack URI, SFT URI)``."""
    from flows.runs import start_run
    from stages.preprocess import preprocess
    from stages.sft import sft_warmup
    from stages.template_pack import template_pack

    ctx = start_run(cfg, run_id)
    tp = template_pack.fn(ctx, cfg.data, cfg.model, preprocess.fn(ctx, cfg.data))
    sft = sft_warmup.fn(ctx, cfg.model, cfg.sft, cfg.trainer, tp) if cfg.sft.enable else None
    return ctx, tp, sft


def shared_sft(cfg: VerlFlowConfig, run_id: str) -> tuple[str, str | None]:
    """preprocess → template_pack → SFT as the pipeline runs them (the data snapshot resolved, the
    tool schemas packed, SFT through its flow) in run ``run_id``: ``(template_pack URI, SFT URI or
    None)``, for RL loops in other run ids that start from the same checkpoint. Committed stages are
    skipped, so a rerun on the same store reuses them."""
    from flows.gpu import sft_flow
    from stages.preprocess import preprocess
    from stages.snapshot import resolve_snapshot
    from stages.template_pack import template_pack

    cfg = cfg.model_copy(update={"data": resolve_snapshot.fn(cfg.data).data})
    ctx = RunContext(run_id=run_id, store_url=cfg.store.url)
    tools = cfg.rollout.multi_turn.tools if cfg.rollout.multi_turn.enable else []
    tp = template_pack.fn(ctx, cfg.data, cfg.model, preprocess.fn(ctx, cfg.data), tools)
    return tp, sft_flow(ctx, cfg, tp) if cfg.sft.enable else None
