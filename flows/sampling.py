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

Resume: the cursor is checkpointed (:func:`stages.floor.state.save_checkpoint`); a rerun of an
iteration starts from the same cursor, finds its committed batches (same cursor, same wanted count →
same stage params) and so makes the same decisions and draws the same prompts.

SPMD: every rank runs this loop; the rollout stage runs on every rank, the main rank scores and reads
the kept count, which :func:`verl_core.runtime.ranks.on_main` hands to every rank, so all ranks stop together.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from flows.loop import Loop
from stages.floor.logging import stage_logger, timed, watched
from stages.floor.state import get_state, set_prompt_cursor
from verl_core.errors import DataError
from verl_core.runtime.ranks import is_main, on_main


class SampledIteration(NamedTuple):
    """Manifest URIs of an iteration's generation batches, in order, and the groups kept of them."""

    rollouts: list[str]
    rewards: list[str]
    kept_groups: int


def sample_iteration(loop: Loop, iteration: int) -> SampledIteration:
    """Generation batches of ``iteration`` until it holds ``data.train_batch_size`` informative groups
    (or the cap), each rolled out and scored by ``loop.stages`` and timed into ``loop.timings``."""
    ctx, cfg, timings = loop.ctx, loop.config, loop.timings
    fg, wanted, stall = cfg.algorithm.filter_groups, cfg.data.train_batch_size, cfg.execution.stall_timeout_s
    state, store = get_state(ctx), ctx.store()
    rollouts: list[str] = []
    rewards: list[str] = []
    kept = 0
    while kept < wanted and (fg.max_num_gen_batches == 0 or len(rollouts) < fg.max_num_gen_batches):
        k, cursor = len(rollouts), state.prompt_cursor
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
        set_prompt_cursor(state, cursor + wanted)
        rollouts.append(r)
        rewards.append(w)
        kept += found
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
