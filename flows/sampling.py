"""DAPO dynamic sampling of one RL iteration (``algorithm.filter_groups``; Yu et al. 2025, §3.2).

Generation batch K = 0, 1, …: roll out ``data.train_batch_size`` prompts from the prompt cursor
(``iter-XXXX/rollout/gen-K``), score them and mark the groups that train (``iter-XXXX/reward/gen-K``),
move the cursor on by one batch; stop when the iteration holds ``data.train_batch_size`` informative
groups or ``max_num_gen_batches`` batches were made (0: no limit). The update then trains on the kept
groups of every batch.

At the cap with fewer groups than wanted: a warning naming the numbers, and the update trains on the
smaller batch. With none at all the iteration fails. verl fails at the cap whatever the count (its
``max_num_gen_batches`` error); we train on what informative groups there are, but an update of zero
informative groups would move the policy by its KL and entropy terms only, and skipping the update
would break the one-update-per-iteration accounting that resume and the run length rest on.

Resume: the cursor is checkpointed (:func:`stages.floor.checkpoint.save_checkpoint`); a rerun of an
iteration starts from the same cursor, finds its committed batches (same cursor, same wanted count →
same stage params) and so makes the same decisions and draws the same prompts.

SPMD: every rank runs this loop; the rollout stage runs on every rank, the main rank scores and reads
the kept count, which :func:`verl_core.runtime.ranks.on_main` hands to every rank, so all ranks stop together.

Metrics: a generation batch's rollout and reward stages log nothing; they leave their metrics in
their summaries (``DEFERRED_METRICS``) and the main rank logs the iteration's batches combined
(:func:`combine_batch_metrics`), once per metric at the iteration's step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from flows.loop import Loop
from stages.floor.logging import DEFERRED_METRICS, stage_logger, timed, watched
from stages.floor.session import RLSession, set_prompt_cursor
from verl_core.data.prompt_stream import next_cursor
from verl_core.errors import DataError
from verl_core.runtime.ranks import is_main, on_main


class SampledIteration(NamedTuple):
    """Manifest URIs of an iteration's generation batches, in order, and the groups kept of them."""

    rollouts: list[str]
    rewards: list[str]
    kept_groups: int


def sample_iteration(loop: Loop, session: RLSession, iteration: int) -> SampledIteration:
    """Generation batches of ``iteration`` until it holds ``data.train_batch_size`` informative groups
    (or the cap), each rolled out and scored by ``loop.stages`` and timed into ``loop.timings``; the
    prompt cursor moves in ``session``."""
    ctx, cfg, timings = loop.ctx, loop.config, loop.timings
    fg, wanted, stall = cfg.algorithm.filter_groups, cfg.data.train_batch_size, cfg.execution.stall_timeout_s
    store = ctx.store()
    rollouts: list[str] = []
    rewards: list[str] = []
    kept = 0
    while kept < wanted and (fg.max_num_gen_batches == 0 or len(rollouts) < fg.max_num_gen_batches):
        k, cursor = len(rollouts), session.prompt_cursor
        with timed(timings, "rollout"), watched(ctx, "rollout", stall, iteration):
            r = loop.stages.rollout(
                ctx, cfg.data, cfg.rollout, loop.template_pack_uri, iteration, loop.lineage, False,
                sandbox=cfg.sandbox, gen_batch=k, cursor=cursor,
            )  # fmt: skip

        def scored(r: str = r, k: int = k, need: int = wanted - kept) -> tuple[str, int]:
            w = loop.stages.reward(
                ctx, cfg.reward, r, iteration, cfg.data.max_response_length, sandbox=cfg.sandbox,
                gen_batch=k, filter_metric=fg.metric, wanted_groups=need,
            )  # fmt: skip
            summary: dict[str, Any] = store.read_manifest(w).summary
            return w, int(summary["filter"]["kept_groups"])

        with timed(timings, "reward"), watched(ctx, "reward", stall, iteration):
            w, found = on_main(scored)  # the main rank scores and decides; every rank gets both
        set_prompt_cursor(session, next_cursor(cursor, wanted))  # one batch on
        rollouts.append(r)
        rewards.append(w)
        kept += found
    if is_main():
        summaries = [
            (store.read_manifest(r).summary, store.read_manifest(w).summary)
            for r, w in zip(rollouts, rewards, strict=True)
        ]
        # (a batch committed before its stages deferred their metrics logged them itself: {})
        batches = [
            ({**r.get(DEFERRED_METRICS, {}), **w.get(DEFERRED_METRICS, {})}, int(r["samples"]))
            for r, w in summaries
        ]
        ctx.tracker().log_metrics(combine_batch_metrics(batches), step=iteration)
    if kept == 0:
        raise DataError(
            f"dynamic sampling: iteration {iteration}: no prompt group among {len(rollouts)} generation "
            f"batches of {wanted} prompts had samples that disagree on algorithm.filter_groups.metric="
            f"{fg.metric!r}; the data is too easy or too hard for the policy (raise "
            "algorithm.filter_groups.max_num_gen_batches, 0: no limit, or change the data)"
        )
    if kept < wanted and is_main():
        stage_logger(__name__).warning(
            "dynamic sampling: iteration %d: %d of %d informative prompt groups after %d generation batches "
            "(algorithm.filter_groups.max_num_gen_batches=%d); training on the smaller batch",
            iteration, kept, wanted, len(rollouts), fg.max_num_gen_batches,
        )  # fmt: skip
    return SampledIteration(rollouts, rewards, kept)


# --------------------------------------------------------------------------------------------------
# One value per metric of an iteration's generation batches

_Combine = Callable[[Sequence[tuple[Mapping[str, float], int]], str], float]
_COUNTS = frozenset({"errors", "failures", "timeouts", "requests", "retries", "failed_requests"})


def _weighted(batches: Sequence[tuple[Mapping[str, float], int]], name: str) -> float:
    """Σ_k n_k·x_k / Σ_k n_k: the mean over all samples of per-batch means x_k of n_k samples."""
    n = sum(c for m, c in batches if name in m)
    return sum(m[name] * c for m, c in batches if name in m) / n if n else math.nan


def _pooled_std(batches: Sequence[tuple[Mapping[str, float], int]], name: str) -> float:
    """The population std of all samples from the batches' (mean m_k, std s_k, count n_k), mean m:
    σ² = Σ_k n_k·(s_k² + (m_k − m)²) / Σ_k n_k."""
    mean_name = name.removesuffix("/std") + "/mean"
    if not all(mean_name in m for m, _ in batches if name in m):
        return _weighted(batches, name)
    mean = _weighted(batches, mean_name)
    n = sum(c for m, c in batches if name in m)
    return math.sqrt(
        sum(c * (m[name] ** 2 + (m[mean_name] - mean) ** 2) for m, c in batches if name in m) / n
    )


def _rate(batches: Sequence[tuple[Mapping[str, float], int]], name: str) -> float:
    """Σ tokens / Σ seconds: the batches' rates weighted by their rollout seconds."""
    seconds = [(m[name], m.get("timing_s/rollout", 0.0)) for m, _ in batches if name in m]
    total = sum(s for _, s in seconds)
    return sum(r * s for r, s in seconds) / total if total > 0 else _weighted(batches, name)


def _values(batches: Sequence[tuple[Mapping[str, float], int]], name: str) -> list[float]:
    return [m[name] for m, _ in batches if name in m]


# (applies to the name, how the batches' values combine), first match wins; otherwise _weighted
_RULES: tuple[tuple[Callable[[str], bool], _Combine], ...] = (
    (lambda k: k.startswith("timing_s/"), lambda b, k: sum(_values(b, k))),  # seconds add up
    (lambda k: k.rsplit("/", 1)[-1] in _COUNTS, lambda b, k: sum(_values(b, k))),  # counts add up
    (lambda k: k.endswith("/max") or k == "train/epoch", lambda b, k: max(_values(b, k))),
    (lambda k: k.endswith("/min"), lambda b, k: min(_values(b, k))),
    (lambda k: k.endswith("/std"), _pooled_std),
    (lambda k: k.endswith("_per_s"), _rate),
)


def combine_batch_metrics(batches: Sequence[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """One value per metric of generation batches given as ``(metrics, samples)``: seconds and counts
    summed, maxima and minima kept, stds pooled, token rates over the total time, every other metric
    (a mean or a fraction) the mean over all samples (weighted by each batch's sample count)."""
    names = sorted({k for m, _ in batches for k in m})
    rule = {k: next((f for applies, f in _RULES if applies(k)), _weighted) for k in names}
    return {k: float(rule[k](batches, k)) for k in names}
