"""Orchestration overhead: the RL iterations as the real Prefect flow vs the same kernels in a plain loop.

    .venv/bin/python benchmarks/orchestration.py      # configs/quickstart_grpo.yaml, 8 iterations, ~2 min
    .venv/bin/python benchmarks/orchestration.py --iterations 10 --repeats 2 \
        data.train_batch_size=8 rollout.n=4 actor.ppo_mini_batch_size=4   # 8×4 samples/iteration, ~1.5 min

Set-up (once, not timed): ``--config`` (default the GRPO quickstart: 32 prompts × 8 samples per
iteration, 4 optimizer steps) plus any dotted overrides, on a temporary local store, tracking off,
validation off, a checkpoint only at the end; our stages
build the data, tokenizer and a briefly SFT-ed policy (``preprocess.fn`` → ``template_pack.fn`` →
``sft_warmup.fn``, ``--sft-steps``). Then the same RL iterations (same config, same seeds, each variant
in its own run id so nothing is skipped) run three ways:

- ``flow``:  ``flows.rl.rl_loop`` — the real Prefect flow: ``init_rl_state`` task, per iteration
  ``flows.rl.run_iteration`` (the ``rollout`` → ``reward`` → ``ppo_update`` tasks; each writes and
  commits its Parquet artifacts, the next reads them), a ``checkpoint`` task at the end; validation off
  (``trainer.test_freq=0``).
- ``fn``:    the same iteration body, ``run_iteration`` with ``loop_stages(cfg, as_tasks=False)`` (the
  stage functions called directly, ``task.fn``), in a plain Python loop after
  ``stages.floor.opening.open_session``, with ``save_checkpoint`` at the end: artifacts written and read
  exactly as in the flow, no Prefect.
- ``bare``:  the components only: ``engine.generate`` on the iteration's prompt ids, the floor's
  ``score_batch`` on the completions, and ``verl_core.training.ppo.ppo_iteration`` on the
  ``RolloutBatch`` of the in-memory rollouts and rewards tables (the floor's ``ppo_models``/``ppo_spec``,
  the update stage's seed) — no artifacts written or read, no manifests, no Prefect. It does not
  sample ReMax's greedy baselines (refused).

Why three: "plain loop" can mean either. ``bare`` is the honest baseline for "what do the stage
boundaries cost" (Prefect task runs + Parquet artifacts + manifests/commits + stage bookkeeping);
``fn`` splits that cost into the Prefect part (flow − fn) and the artifact part (fn − bare).

Timed per iteration (the loop: the sum of rollout + reward + update as the caller sees them;
``run_iteration`` times them around its stage calls, and the flow returns its timings); reported
separately: the per-run fixed costs (flow run creation, ``init_rl_state``/``checkpoint`` tasks vs the
direct calls) and the one-off Prefect start-up (the ephemeral API server, measured with an empty flow
before anything else; later empty flows are timed too). Overhead = (loop_flow − loop_bare) / iterations,
and as % of loop_bare (target ≤ 5%). The variants' results are compared (per-iteration generated tokens
and mean scores, final weights): same seeds should give the same run whichever way it is driven.
Variants alternate order across ``--repeats``; the median of each is reported. A shared, loaded machine
makes ±5% noise likely: read the per-iteration milliseconds rather than the percentage alone.

Within-run split (2.): kernel = the seconds the stages record in their manifest summaries (rollout
``seconds`` = engine.generate, reward ``seconds`` = score_batch, update ``timing_s/*``), stage body =
``task.fn`` as called, task call = ``run_iteration``'s timers.

Figures measured so far: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from verl_core.runtime.env import set_quiet_env  # noqa: E402

set_quiet_env(offline=True)

import torch  # noqa: E402
from _setup import base_overrides, build_inputs  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--config", default=str(REPO / "configs" / "quickstart_grpo.yaml"), help="base config (GRPO)"
    )
    p.add_argument("--iterations", type=int, default=8, help="RL iterations per run")
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant (alternating order)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared 2-core box)")
    p.add_argument(
        "--sft-steps", type=int, default=20, help="SFT warm-up steps before RL (0: scratch policy)"
    )
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides (e.g. actor.use_kl_loss=true)")
    return p.parse_args()


def setup(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from verl_core.config import load_config

    overrides = [
        *base_overrides(root, args.iterations, args.sft_steps),
        "trainer.val_before_train=false",
        "trainer.save_freq=0",
        *args.overrides,
    ]
    cfg = load_config(args.config, overrides)
    if cfg.algorithm.greedy_baseline:
        raise SystemExit("the bare loop does not sample ReMax's greedy baselines (algorithm.adv_estimator)")
    t0 = time.perf_counter()
    _, tp, sft = build_inputs(cfg)
    print(
        f"set-up (preprocess + template_pack + sft {args.sft_steps} steps): {time.perf_counter() - t0:.1f} s"
    )
    return {"cfg": cfg, "tp": tp, "sft": sft}


class Probe:
    """Times, within one run, the stage bodies (``task.fn``, as the Prefect task engine and
    ``run_iteration`` without tasks call them). Task call − body is the Prefect cost of a task;
    body − kernel (the kernel seconds the stages record in their manifests) is the artifact +
    bookkeeping cost: both measured on the same executions, so load drift on a shared machine cancels
    out of them."""

    def __init__(self) -> None:
        from stages.ppo_update import ppo_update
        from stages.reward import reward
        from stages.rollout import rollout

        self.body: dict[str, float] = defaultdict(float)
        for name, task_obj in (("rollout", rollout), ("reward", reward), ("update", ppo_update)):
            task_obj.fn = self._timed(task_obj.fn, name)

    def _timed(self, fn: Any, name: str) -> Any:
        import functools

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.body[name] += time.perf_counter() - t

        return wrapper

    def reset(self) -> None:
        self.body.clear()


PROBE: Probe | None = None


def _weights_sum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


# --------------------------------------------------------------------------------------------------
# The three drivers. Each returns loop_s (sum of per-iteration rollout + reward + update), total_s
# (the whole call), per-iteration tokens and mean scores, and the final weights' checksum.


def run_flow(s: dict[str, Any], run_id: str) -> dict[str, Any]:
    from flows.rl import rl_loop
    from flows.runs import start_run
    from stages.floor.artifacts import read_policy

    cfg = s["cfg"]
    ctx = start_run(cfg, run_id)
    t0 = time.perf_counter()
    out = rl_loop(ctx, cfg, s["tp"], s["sft"])
    total = time.perf_counter() - t0
    store = ctx.store()
    tokens, scores, kernel = _from_manifests(store, run_id, cfg.trainer.total_iterations)
    lm = read_policy(store, store.read_manifest(out.checkpoint), "policy", cfg.model)
    parts = out.timing_s
    assert PROBE is not None
    return {
        "loop_s": parts["rollout"] + parts["reward"] + parts["update"],
        "parts": {k: parts[k] for k in ("rollout", "reward", "update")},
        "body": dict(PROBE.body),
        "kernel": kernel,
        "total_s": total,
        "tokens": tokens,
        "scores": scores,
        "weights": _weights_sum(lm),
    }


def run_fn(s: dict[str, Any], run_id: str) -> dict[str, Any]:
    from flows.loop import Loop
    from flows.rl import loop_stages, run_iteration
    from flows.runs import start_run
    from stages.floor.checkpoint import save_checkpoint
    from stages.floor.opening import open_session
    from stages.floor.session import bound

    cfg = s["cfg"]
    ctx = start_run(cfg, run_id)
    parts: dict[str, float] = defaultdict(float)
    t0 = time.perf_counter()
    state = open_session(ctx, cfg, s["tp"], s["sft"])
    loop = Loop(ctx, cfg, s["tp"], state.lineage, state.iterations, parts, loop_stages(cfg, as_tasks=False))
    try:
        with bound(state):  # the stage functions find the session as the loop's task shells do
            for it in range(cfg.trainer.total_iterations):
                run_iteration(loop, state, it)
        save_checkpoint(state, ctx, cfg, cfg.trainer.total_iterations)
        weights = _weights_sum(state.lm)
    finally:
        state.close()
    total = time.perf_counter() - t0
    tokens, scores, kernel = _from_manifests(ctx.store(), run_id, cfg.trainer.total_iterations)
    assert PROBE is not None
    return {
        "loop_s": sum(parts.values()),
        "parts": dict(parts),
        "body": dict(PROBE.body),
        "kernel": kernel,
        "total_s": total,
        "tokens": tokens,
        "scores": scores,
        "weights": weights,
    }


def run_bare(s: dict[str, Any], run_id: str, iterations: int | None = None) -> dict[str, Any]:
    from flows.runs import start_run
    from stages.floor.artifacts import rollouts_table
    from stages.floor.opening import open_session
    from stages.floor.rollouts import sampling_params
    from stages.floor.scorers import build_scorers, score_batch
    from stages.floor.session import ppo_models
    from stages.floor.specs import ppo_spec, update_seed
    from verl_core.data.prompt_stream import iteration_batch
    from verl_core.reward import batch_from_columns, rewards_table
    from verl_core.training.batch import RolloutBatch
    from verl_core.training.ppo import ppo_iteration

    cfg = s["cfg"]
    ctx = start_run(cfg, run_id)
    store = ctx.store()
    parts: dict[str, float] = defaultdict(float)
    t0 = time.perf_counter()
    state = open_session(ctx, cfg, s["tp"], s["sft"])
    prompts = store.read_table(store.read_manifest(s["tp"]), "prompt_tokens/train.parquet")
    scorers = build_scorers(cfg.reward, cfg.sandbox)
    d = cfg.data
    tokens: list[int] = []
    scores: list[float] = []
    try:
        for it in range(iterations or cfg.trainer.total_iterations):
            t = time.perf_counter()
            taken = iteration_batch(prompts.num_rows, d.train_batch_size, it, seed=d.seed, shuffle=d.shuffle)
            batch = prompts.take(taken.rows)
            completions = state.engine.generate(
                batch.column("input_ids").to_pylist(),
                sampling_params(cfg.rollout, d.max_response_length, it, validation=False),
            )
            parts["rollout"] += time.perf_counter() - t
            t = time.perf_counter()
            table = rollouts_table(completions, batch, it, state.version)  # in memory, never written
            rb = batch_from_columns(table)
            result = score_batch(cfg.reward, cfg.sandbox, rb, d.max_response_length, scorers)
            parts["reward"] += time.perf_counter() - t
            t = time.perf_counter()
            update = ppo_iteration(
                ppo_models(state),
                RolloutBatch.from_tables(table, rewards_table(rb, result)),
                ppo_spec(cfg, it),
                kl_ctrl=state.kl_ctrl,
                seed=update_seed(cfg, it),  # the update stage's seed
                where=f"bare update iteration {it}",
            )
            state.version = it + 1
            parts["update"] += time.perf_counter() - t
            tokens.append(sum(len(c.response_ids) for c in completions))
            scores.append(update.metrics["critic/score/mean"])
        weights = _weights_sum(state.lm)
    finally:
        state.close()
    return {
        "loop_s": sum(parts.values()),
        "parts": dict(parts),
        "body": dict(parts),
        "kernel": dict(parts),
        "total_s": time.perf_counter() - t0,
        "tokens": tokens,
        "scores": scores,
        "weights": weights,
    }


def _from_manifests(
    store: Any, run_id: str, iterations: int
) -> tuple[list[int], list[float], dict[str, float]]:
    """Per-iteration generated tokens and mean scores, and the kernel seconds the stages recorded:
    rollout ``seconds`` (engine.generate), reward ``seconds`` (score_batch), update ``timing_s/*``
    (log-probs, advantages, optimizer)."""
    from stages.floor.locations import iteration_stage

    tokens, scores = [], []
    kernel = {"rollout": 0.0, "reward": 0.0, "update": 0.0}

    def summary(it: int, stage: str) -> dict[str, Any]:
        return store.read_manifest(store.manifest_uri(run_id, iteration_stage(it, stage))).summary

    for it in range(iterations):
        rs, ws, us = summary(it, "rollout"), summary(it, "reward"), summary(it, "update")
        tokens.append(rs["generated_tokens"])
        scores.append(us["critic/score/mean"])
        kernel["rollout"] += rs["seconds"]
        kernel["reward"] += ws["seconds"]
        kernel["update"] += sum(v for k, v in us.items() if k.startswith("timing_s/"))
    return tokens, scores, kernel


# --------------------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}; CPU, fp32, {args.threads} thread(s); "
        f"{args.iterations} iterations per run"
    )
    from prefect import flow

    @flow(name="orchestration-empty")
    def empty() -> None:
        return None

    with tempfile.TemporaryDirectory(prefix="orchestration-") as tmp:
        s = setup(args, Path(tmp))
        t = time.perf_counter()
        empty()
        startup = time.perf_counter() - t
        empties = []
        for _ in range(2):
            t = time.perf_counter()
            empty()
            empties.append(time.perf_counter() - t)
        print(
            f"Prefect start-up (ephemeral server + first empty flow, one-off): {startup:.1f} s; "
            f"later empty flows: {', '.join(f'{e:.2f}' for e in empties)} s"
        )
        t = time.perf_counter()
        run_bare(s, "warmup", iterations=1)
        print(f"warm-up (1 bare iteration, not counted): {time.perf_counter() - t:.1f} s")
        global PROBE
        PROBE = Probe()
        drivers = {"flow": run_flow, "fn": run_fn, "bare": run_bare}
        results: dict[str, list[dict[str, Any]]] = {k: [] for k in drivers}
        order = list(drivers)
        for rep in range(args.repeats):
            for name in order if rep % 2 == 0 else order[::-1]:
                PROBE.reset()
                r = drivers[name](s, f"{name}-{rep}")
                results[name].append(r)
                print(
                    f"  run {rep + 1} {name:>4}: loop {r['loop_s']:6.2f} s "
                    f"({', '.join(f'{k} {v:.2f}' for k, v in r['parts'].items())}), "
                    f"whole call {r['total_s']:6.2f} s"
                )
        report(results, args, startup)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, startup: float) -> None:
    n = args.iterations
    parts = ("rollout", "reward", "update")

    def med(k: str, f: Any) -> float:
        return statistics.median(f(r) for r in results[k])

    print(f"\n1. the three ways, median (min) over {args.repeats} run(s) of {n} iterations:")
    for k, label in (
        ("flow", "Prefect flow rl_loop (tasks + artifacts)"),
        ("fn", "run_iteration, no tasks (artifacts)"),
        ("bare", "bare kernels plain loop"),
    ):
        loop = med(k, lambda r: r["loop_s"])
        best = min(r["loop_s"] for r in results[k])
        total = med(k, lambda r: r["total_s"])
        print(
            f"  {label:<42} loop {loop:6.2f} s ({best:6.2f}) = {1000 * loop / n:6.1f} ms/iteration; "
            f"whole call {total:6.2f} s (fixed per run {total - loop:5.2f} s)"
        )
    flow, fn, bare = (med(k, lambda r: r["loop_s"]) for k in ("flow", "fn", "bare"))
    print(
        f"  flow − bare: {1000 * (flow - bare) / n:+7.1f} ms/iteration "
        f"({100 * (flow - bare) / bare:+5.1f}%); "
        f"flow − fn: {1000 * (flow - fn) / n:+7.1f} ms/iteration; fn − bare: {1000 * (fn - bare) / n:+7.1f} "
        f"ms/iteration  (different runs: on a shared machine the load between them moves these by more "
        f"than the overhead; 2. is measured within the same runs)"
    )

    print("\n2. within the same runs, ms/iteration (median over runs):")
    print(f"  {'':<10}{'kernel':>9}{'stage body':>12}{'task call':>11}{'artifacts+':>12}{'Prefect':>9}")
    rows = {}
    for part in parts:
        kf = med("flow", lambda r, p=part: r["kernel"][p]) / n
        bf = med("flow", lambda r, p=part: r["body"][p]) / n
        tf = med("flow", lambda r, p=part: r["parts"][p]) / n
        rows[part] = (kf, bf, tf)
        print(
            f"  {part:<10}{1000 * kf:9.1f}{1000 * bf:12.1f}{1000 * tf:11.1f}{1000 * (bf - kf):12.1f}"
            f"{1000 * (tf - bf):9.1f}"
        )
    k_sum = sum(v[0] for v in rows.values())
    b_sum = sum(v[1] for v in rows.values())
    t_sum = sum(v[2] for v in rows.values())
    print(
        f"  {'total':<10}{1000 * k_sum:9.1f}{1000 * b_sum:12.1f}{1000 * t_sum:11.1f}"
        f"{1000 * (b_sum - k_sum):12.1f}{1000 * (t_sum - b_sum):9.1f}"
    )
    over = t_sum - k_sum
    print(
        f"  flow: orchestration overhead {1000 * over:.1f} ms/iteration = {100 * over / k_sum:.1f}% of the "
        f"kernels (target ≤ 5%: {'met' if over <= 0.05 * k_sum else 'not met'}); Prefect tasks alone "
        f"{1000 * (t_sum - b_sum):.1f} ms/iteration = {100 * (t_sum - b_sum) / b_sum:.1f}% of the "
        f"stage bodies; "
        f"artifacts + stage bookkeeping {1000 * (b_sum - k_sum):.1f} ms/iteration"
    )
    fk = sum(med("fn", lambda r, p=p: r["kernel"][p]) for p in parts) / n
    fb = sum(med("fn", lambda r, p=p: r["body"][p]) for p in parts) / n
    print(
        f"  fn loop (same stages, no Prefect): kernels {1000 * fk:.1f}, stage bodies {1000 * fb:.1f} → "
        f"artifacts + bookkeeping {1000 * (fb - fk):.1f} ms/iteration ({100 * (fb - fk) / fk:.1f}%)"
    )
    print(
        "  kernel = engine.generate (rollout summary 'seconds'), score_batch (reward summary 'seconds'), "
        "the update's timed phases (timing_s/*); stage body = task.fn as called; task call = "
        "run_iteration's own timers"
    )
    print(
        f"\n3. fixed costs: one-off Prefect start-up (ephemeral server) {startup:.1f} s, not in the above; "
        f"per flow run (flow run creation, init_rl_state + checkpoint tasks): "
        f"{med('flow', lambda r: r['total_s'] - r['loop_s']):.2f} s vs "
        f"{med('fn', lambda r: r['total_s'] - r['loop_s']):.2f} s for the direct "
        "open_session + save_checkpoint"
    )
    ref = results["bare"][0]
    same = all(
        r["tokens"] == ref["tokens"]
        and all(abs(a - b) < 1e-6 for a, b in zip(r["scores"], ref["scores"], strict=True))
        and abs(r["weights"] - ref["weights"]) <= 1e-6 * abs(ref["weights"])
        for runs in results.values()
        for r in runs
    )
    print(
        f"4. same run every way (per-iteration generated tokens, mean scores, final weights): "
        f"{'yes' if same else 'NO'}; generated tokens per iteration {ref['tokens']}"
    )
    if not same:
        for k, runs in results.items():
            for r in runs:
                print(f"    {k}: tokens {r['tokens']} weights {r['weights']:.6f}")


if __name__ == "__main__":
    main()
