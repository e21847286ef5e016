"""Learning: does the RL phase raise held-out accuracy over the SFT checkpoint? The real pipeline
(``flows.pipeline.rlhf_pipeline``: preprocess → template_pack → SFT → RL → export → eval), once per
(config, seed), each in its own run on a temporary local store, one after the other in this process.

    .venv/bin/python benchmarks/learning.py            # quickstart (PPO) + quickstart_grpo, seeds 1 2 3
    .venv/bin/python benchmarks/learning.py --configs configs/quickstart.yaml --seeds 1
    .venv/bin/python benchmarks/learning.py trainer.total_iterations=30   # overrides for every run
    .venv/bin/python benchmarks/learning.py rollout.name=vllm --configs configs/quickstart.yaml   # on vLLM
    .venv/bin/python benchmarks/learning.py --tools   # quickstart_tools (multi-turn, calculator), seeds 1 2 3
    .venv/bin/python benchmarks/learning.py --sharpen   # quickstart_sharpen: GRPO + PPO + SFT-only control
    .venv/bin/python benchmarks/learning.py --configs configs/quickstart_grpo.yaml \
        --variants base: ahead:trainer.rollout_ahead=1,rollout.share_weights=false \
        base_own:rollout.share_weights=false \
        --pairs ahead=base_own --store /tmp/learning-variants   # one SFT per seed, 3 RL loops on it

A seed sets ``data.seed`` (which problems, which held out, shuffling), ``trainer.seed`` (model init,
dropout-free training order) and ``rollout.seed`` (sampling). Accuracy is greedy exact-match on the
held-out split, as the pipeline's validation computes it: iteration 0 is the SFT checkpoint (before any
RL update), the last is after RL. Prints one row per run and the mean/min gain per config (target:
≥ +0.15 for every seed), plus wall time per run (target for ``make quickstart``: ≤ 10 min).

``--tools`` runs ``configs/quickstart_tools.yaml`` and also prints the tool-call rate (share of
sampled responses with at least one tool call, ``multi_turn/tool_call_rate`` of the rollout stages'
summaries) of the first 3 vs the last 3 RL iterations (target: last above first, and the +0.15 gain,
on every seed), and of the greedy held-out validations (SFT checkpoint vs after RL).

``--variants NAME:OVERRIDES ...`` compares named override sets on a shared SFT checkpoint: per
(config, seed), preprocess → template_pack → SFT run once (run id ``learning-<config>-seed<s>``),
then the RL loop with its validations once per variant (run id ``…-seed<s>-<NAME>``) on that
checkpoint, one after the other. ``OVERRIDES`` are dotted overrides joined by commas
(``ahead:trainer.rollout_ahead=1,rollout.share_weights=false``; a comma inside a value, as in
``[a,b]``, stays: only a comma followed by ``key=`` splits); ``NAME:`` alone is the config as it is.
Tracking is off in this mode (the RL loops run without the pipeline's MLflow run), and export/eval
are not run. Prints one row per (config, seed, variant): SFT → after-RL greedy held-out accuracy and
the RL loop's seconds per iteration (wall − validation, / iterations), then per variant the mean ±
sample std over seeds and the check "variant mean ≥ baseline mean − max(0.03, std(baseline))"
(issue 16's "learning is not hurt"), against ``--baseline`` (default: the first variant) and against
the variant's partner in ``--pairs VARIANT=BASELINE`` (a fair pair, e.g. an engine with its own
weights on both sides). With ``--store`` a rerun skips what is committed and resumes the RL loops.
``--sft-control`` (with ``--variants``) also runs, per (config, seed), the SFT-only control: SFT from
scratch for more epochs, as many more as the longest variant's RL stage seconds buy at the shared
SFT's pace (run id ``…-seed<s>-sft_control``), validated like an RL loop's iteration 0; then prints
per run SFT → RL greedy accuracy, the control's, pass@1 / pass@k of all three, and per variant issue
19's check: RL ≥ SFT + 0.10 and RL ≥ control + 0.10 on every seed. ``--sharpen`` without
``--variants`` is ``configs/quickstart_sharpen.yaml`` with the variants ``grpo:`` (the config) and
``ppo:algorithm.adv_estimator=gae`` on one SFT per seed, and the control.
``--diagnostics`` also prints each run's per-iteration update metrics (ppo_kl, clip fraction,
entropy, share of zero-variance groups, mean |advantage|, mean score, rollout-correction KL).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from verl_core.runtime.env import set_quiet_env  # noqa: E402

set_quiet_env(offline=True)

if TYPE_CHECKING:
    from verl_core.config import VerlFlowConfig
    from verl_core.store import ArtifactStore

DEFAULT_CONFIGS = ["configs/quickstart.yaml", "configs/quickstart_grpo.yaml"]
TOOLS_CONFIGS = ["configs/quickstart_tools.yaml"]
SHARPEN_CONFIGS = ["configs/quickstart_sharpen.yaml"]
# --sharpen: the config's GRPO and its PPO (the config holds the critic's settings) on one SFT per seed
SHARPEN_VARIANTS = ["grpo:", "ppo:algorithm.adv_estimator=gae"]
TOOL_RATE = "multi_turn/tool_call_rate"
TARGET_GAIN = {"quickstart_sharpen": 0.10}  # else 0.15
NOT_HURT_MARGIN = 0.03  # issue 16: variant mean ≥ baseline mean − max(0.03, std(baseline))
_OVERRIDE_SPLIT = re.compile(r",(?=[A-Za-z_][\w.]*=)")  # a comma that starts the next `key=`
_VARIANT_NAME = re.compile(r"[A-Za-z0-9_-]+")
# per-iteration update metrics printed by --diagnostics (from the ppo_update stages' summaries)
DIAGNOSTICS = {
    "actor/ppo_kl": "ppo_kl",
    "actor/pg_clipfrac": "clipfrac",
    "actor/entropy": "entropy",
    "batch/zero_variance_groups": "zero_var",
    "critic/advantages/abs_mean": "|adv|",
    "critic/score/mean": "score",
    "rollout_corr/kl": "corr_kl",
}


@dataclass(frozen=True)
class Variant:
    """A named set of dotted overrides applied to the RL loop (not to the shared SFT)."""

    name: str
    overrides: tuple[str, ...]


def parse_variants(specs: list[str]) -> list[Variant]:
    """``["NAME:k=v,k2=v2", "NAME:"]`` → variants, in order; names unique, overrides ``key=value``."""
    variants: list[Variant] = []
    for spec in specs:
        name, sep, rest = spec.partition(":")
        if not sep or not _VARIANT_NAME.fullmatch(name):
            raise SystemExit(f"--variants {spec!r}: write NAME:key=value,key=value (NAME of [A-Za-z0-9_-])")
        overrides = tuple(o for o in _OVERRIDE_SPLIT.split(rest) if o) if rest else ()
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise SystemExit(f"--variants {spec!r}: {bad[0]!r} is not a dotted key=value override")
        if any(v.name == name for v in variants):
            raise SystemExit(f"--variants: {name!r} named twice")
        variants.append(Variant(name, overrides))
    return variants


def not_hurt(variant: list[float], baseline: list[float]) -> tuple[bool, float]:
    """(variant mean ≥ baseline mean − max(0.03, sample std of the baseline), that bound)."""
    spread = statistics.stdev(baseline) if len(baseline) > 1 else 0.0
    bound = statistics.mean(baseline) - max(NOT_HURT_MARGIN, spread)
    return statistics.mean(variant) >= bound, bound


def pass_at_k_before_after(
    store: ArtifactStore, run_id: str
) -> tuple[int, float, float, float, float] | None:
    """(k, pass@1 of the SFT checkpoint, pass@1 after RL, pass@k SFT, pass@k RL) from the run's
    validation summaries; None when the validations did not sample (eval.k = 1)."""
    from stages.floor.locations import iteration_summaries

    vals = list(iteration_summaries(store, run_id, "val").values())
    ks = [int(key.rsplit("_", 1)[1]) for key in vals[0] if key.startswith("val/pass_at_")] if vals else []
    k = max(ks, default=1)
    if k == 1:
        return None
    first, last = vals[0], vals[-1]
    return (
        k,
        first["val/pass_at_1"],
        last["val/pass_at_1"],
        first[f"val/pass_at_{k}"],
        last[f"val/pass_at_{k}"],
    )


def report_passes(store: ArtifactStore, run_id: str) -> tuple[int, float, float, float, float] | None:
    """:func:`pass_at_k_before_after` of the run, printed as one line when the validations sampled."""
    passes = pass_at_k_before_after(store, run_id)
    if passes is not None:
        k, p1_sft, p1_rl, pk_sft, pk_rl = passes
        print(
            f"{run_id}: pass@1 SFT {p1_sft:.3f} → RL {p1_rl:.3f}; pass@{k} SFT {pk_sft:.3f} → RL {pk_rl:.3f}",
            flush=True,
        )
    return passes


def tool_call_rates(store: ArtifactStore, run_id: str) -> tuple[float, float, float, float]:
    """(mean rate of the first 3 RL iterations' rollouts, of the last 3, greedy validation rate of
    the SFT checkpoint, of the last validation), read from the run's committed stage summaries."""
    from stages.floor.locations import iteration_summaries

    rollouts = [s[TOOL_RATE] for s in iteration_summaries(store, run_id, "rollout").values()]
    vals = [s[f"val/{TOOL_RATE}"] for s in iteration_summaries(store, run_id, "val").values()]
    if len(rollouts) < 6 or not vals:
        raise SystemExit(f"{run_id}: fewer than 6 RL iterations or no validation with multi-turn metrics")
    return statistics.mean(rollouts[:3]), statistics.mean(rollouts[-3:]), vals[0], vals[-1]


@dataclass(frozen=True)
class VariantRow:
    config: str
    seed: int
    variant: str
    sft: float
    rl: float
    s_per_iteration: float
    wall_s: float
    passes: tuple[int, float, float, float, float] | None = None  # pass_at_k_before_after
    train_s: float = 0.0  # the RL stages' recorded seconds (rl_stage_seconds), what sizes the control


@dataclass(frozen=True)
class ControlRow:
    """The SFT-only control of one (config, seed): SFT from scratch for ``epochs`` (the shared SFT's
    epochs plus as many as the longest RL loop's training seconds buy), greedy held-out accuracy and
    sampled pass@1 / pass@k of its checkpoint."""

    config: str
    seed: int
    epochs: int
    accuracy: float
    pass_at_1: float | None
    pass_at_k: float | None


def run_variants(
    configs: list[str],
    seeds: list[int],
    variants: list[Variant],
    root: str,
    overrides: list[str],
    diagnostics: bool = False,
    control: bool = False,
) -> tuple[list[VariantRow], list[ControlRow], list[str]]:
    """Per (config, seed): one shared SFT, then the RL loop of every variant on it; ``diagnostics``:
    also print each run's per-iteration update metrics; ``control``: then the SFT-only control
    (:func:`run_sft_control`). Returns the rows, the control rows and the failed runs."""
    from _setup import shared_sft

    from verl_core.config import load_config
    from verl_core.store import ArtifactStore

    rows: list[VariantRow] = []
    controls: list[ControlRow] = []
    failed: list[str] = []
    for config in configs:
        stem = Path(config).stem
        for seed in seeds:
            common = [
                f"store.url={root}", f"data.seed={seed}", f"trainer.seed={seed}", f"rollout.seed={seed}",
                "tracking.enabled=false", *overrides,
            ]  # fmt: skip
            # every variant's config checked before the SFT (a typo should not wait for it)
            cfgs = [load_config(str(REPO / config), [*common, *v.overrides]) for v in variants]
            base = load_config(str(REPO / config), common)  # the shared SFT's (and the control's) config
            t0 = time.perf_counter()
            tp, sft = shared_sft(base, f"learning-{stem}-seed{seed}")
            print(f"{stem} seed {seed}: shared SFT in {time.perf_counter() - t0:.0f} s", flush=True)
            for v, cfg in zip(variants, cfgs, strict=True):
                run_id = f"learning-{stem}-seed{seed}-{v.name}"
                try:  # one variant failing (e.g. dynamic sampling finding no informative group) is a result
                    rows.append(run_variant(cfg, run_id, stem, seed, v.name, tp, sft))
                except Exception as e:
                    failed.append(f"{run_id}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    print(f"{failed[-1]} (FAILED, going on)", flush=True)
                    continue
                if diagnostics:
                    print_diagnostics(ArtifactStore(root), run_id)
            mine = [r.train_s for r in rows if r.config == stem and r.seed == seed]
            if control and mine:
                controls.append(run_sft_control(base, stem, seed, sft, max(mine)))
    return rows, controls, failed


def run_sft_control(
    cfg: VerlFlowConfig, config: str, seed: int, sft_uri: str | None, rl_train_s: float
) -> ControlRow:
    """The SFT-only control: SFT from scratch (run id ``learning-<config>-seed<s>-sft_control``) for
    :func:`control_epochs` (the shared SFT's ``train_seconds``, :func:`rl_stage_seconds`): the same extra
    wall time spent on more SFT instead of RL, the schedule (warm-up, cosine) stretched over the
    longer run. Its checkpoint is validated like the RL loop's iteration 0 (greedy accuracy; pass@k
    when ``eval.k`` > 1)."""
    from _setup import shared_sft

    from stages.floor.locations import iteration_summaries
    from stages.floor.opening import open_session
    from stages.floor.session import bound
    from stages.validate import validate
    from verl_core.runtime.run import RunContext
    from verl_core.store import ArtifactStore

    store = ArtifactStore(cfg.store.url)
    if sft_uri is None:
        raise SystemExit(f"{config} seed {seed}: the SFT-only control needs sft.enable")
    shared = store.read_manifest(sft_uri).summary
    sft_s = float(shared["train_seconds"])
    epochs = control_epochs(cfg.sft.epochs, sft_s, rl_train_s)
    ccfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"epochs": epochs})})
    run_id = f"learning-{config}-seed{seed}-sft_control"
    t0 = time.perf_counter()
    tp, sft = shared_sft(ccfg, run_id)
    ctx = RunContext(run_id=run_id, store_url=cfg.store.url)
    session = open_session(ctx, ccfg, tp, sft)
    try:
        with bound(session):  # the validate task's shell finds the session as in the RL loop
            accuracy = validate.fn(
                ctx,
                ccfg.data,
                ccfg.rollout,
                ccfg.reward,
                ccfg.eval,
                ccfg.sandbox,
                tp,
                0,
                ccfg.tracking.log_samples,
            )
    finally:
        session.close()
    losses = (shared["final_val_loss"], store.read_manifest(sft).summary["final_val_loss"]) if sft else None
    summary = iteration_summaries(store, run_id, "val")[0]
    k = ccfg.eval.k
    p1, pk = summary.get("val/pass_at_1"), summary.get(f"val/pass_at_{k}")
    print(
        f"{run_id}: {epochs} SFT epochs (the shared SFT's {cfg.sft.epochs} took {sft_s:.0f} s; the RL loop "
        f"{rl_train_s:.0f} s), greedy {accuracy:.3f}"
        + (f", pass@1 {p1:.3f}, pass@{k} {pk:.3f}" if p1 is not None and pk is not None else "")
        + (f", SFT held-out loss {losses[0]:.4f} → {losses[1]:.4f}" if losses else "")
        + f", {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    return ControlRow(config, seed, epochs, accuracy, p1, pk)


def run_variant(
    cfg: VerlFlowConfig, run_id: str, config: str, seed: int, variant: str, tp: str, sft: str | None
) -> VariantRow:
    """One RL loop (with its validations) from the shared SFT checkpoint, printed as it ends."""
    from flows.rl import rl_loop
    from verl_core.runtime.run import RunContext
    from verl_core.store import ArtifactStore

    t0 = time.perf_counter()
    out = rl_loop(RunContext(run_id=run_id, store_url=cfg.store.url), cfg, tp, sft)
    wall = time.perf_counter() - t0
    acc, last = out.val_accuracy, max(out.val_accuracy)
    if 0 not in acc or last == 0:
        raise SystemExit(f"{run_id}: needs validations before and after RL (val_before_train)")
    per_it = (wall - out.timing_s.get("validate", 0.0)) / last
    print(
        f"{run_id}: SFT {acc[0]:.3f} → RL {acc[last]:.3f} ({acc[last] - acc[0]:+.3f}) after "
        f"{last} iterations, {per_it:.2f} s/iteration, {wall:.0f} s",
        flush=True,
    )
    passes = report_passes(ArtifactStore(cfg.store.url), run_id)
    train_s = rl_stage_seconds(ArtifactStore(cfg.store.url), run_id)
    return VariantRow(config, seed, variant, acc[0], acc[last], per_it, wall, passes, train_s)


def print_variants(rows: list[VariantRow], baseline: str, pairs: dict[str, str]) -> None:
    """The per-run table, then per (config, variant) the mean ± std and the not-hurt checks."""
    print(f"\n{'config':<18} {'seed':>4} {'variant':<12} {'SFT':>6} {'RL':>6} {'gain':>7} {'s/iter':>7}")
    for r in rows:
        print(
            f"{r.config:<18} {r.seed:>4} {r.variant:<12} {r.sft:>6.3f} {r.rl:>6.3f} "
            f"{r.rl - r.sft:>+7.3f} {r.s_per_iteration:>7.2f}"
        )
    for config in dict.fromkeys(r.config for r in rows):
        acc = {
            v: [r.rl for r in rows if r.config == config and r.variant == v]
            for v in dict.fromkeys(r.variant for r in rows)
        }
        for name, accs in acc.items():
            spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
            mine = [r for r in rows if r.config == config and r.variant == name]
            per_it = statistics.mean(r.s_per_iteration for r in mine)
            checks = []
            for ref in dict.fromkeys(x for x in (baseline, pairs.get(name)) if x and x != name and x in acc):
                ok, bound = not_hurt(accs, acc[ref])
                checks.append(f"vs {ref}: {'passes' if ok else 'FAILS'} (≥ {bound:.3f})")
            print(
                f"{config} {name}: RL {statistics.mean(accs):.3f} ± {spread:.3f} over {len(accs)} seeds, "
                f"{per_it:.2f} s/iteration; " + ("; ".join(checks) or "baseline")
            )


def print_sharpening(rows: list[VariantRow], controls: list[ControlRow]) -> None:
    """Per (config, seed, variant): SFT → RL greedy accuracy, the SFT-only control, pass@1 / pass@k
    before and after; then per (config, variant) issue 19's check: RL ≥ SFT + target and RL ≥ control
    + target on every seed."""
    ctl = {(c.config, c.seed): c for c in controls}
    heads = ("SFT", "RL", "control", "vs SFT", "vs ctl", "p@1 SFT", "p@1 RL", "p@1 ctl", "p@k SFT", "p@k RL")
    print(f"\n{'config':<18} {'seed':>4} {'variant':<8} " + " ".join(f"{h:>7}" for h in (*heads, "p@k ctl")))

    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    for r in rows:
        c = ctl.get((r.config, r.seed))
        _, p1_sft, p1_rl, pk_sft, pk_rl = r.passes or (1, None, None, None, None)
        cells = (
            f(r.sft), f(r.rl), f(c.accuracy if c else None), f"{r.rl - r.sft:+.3f}",
            f"{r.rl - c.accuracy:+.3f}" if c else "-", f(p1_sft), f(p1_rl), f(c.pass_at_1 if c else None),
            f(pk_sft), f(pk_rl), f(c.pass_at_k if c else None),
        )  # fmt: skip
        print(f"{r.config:<18} {r.seed:>4} {r.variant:<8} " + " ".join(f"{x:>7}" for x in cells))
    for config in dict.fromkeys(r.config for r in rows):
        target = TARGET_GAIN.get(config, 0.15)
        for name in dict.fromkeys(r.variant for r in rows if r.config == config):
            mine = [r for r in rows if r.config == config and r.variant == name]
            ok, vs_sft, vs_ctl = sharpens(mine, controls, target)
            print(
                f"{config} {name}: min over {len(mine)} seeds RL − SFT {vs_sft:+.3f}, RL − control "
                + ("-" if vs_ctl is None else f"{vs_ctl:+.3f}")
                + f" ({'meets' if ok else 'misses'} the +{target:.2f} target on both)"
            )


def sharpens(
    rows: list[VariantRow], controls: list[ControlRow], target: float
) -> tuple[bool, float, float | None]:
    """Issue 19's check over one variant's ``rows`` (one per seed): ``(RL ≥ SFT + target and RL ≥
    control + target on every seed, min RL − SFT, min RL − control or None when a seed has no control)``."""
    ctl = {(c.config, c.seed): c.accuracy for c in controls}
    vs_sft = min(r.rl - r.sft for r in rows)
    gaps = [r.rl - ctl[(r.config, r.seed)] for r in rows if (r.config, r.seed) in ctl]
    vs_ctl = min(gaps) if len(gaps) == len(rows) else None
    return vs_sft >= target and vs_ctl is not None and vs_ctl >= target, vs_sft, vs_ctl


def rl_stage_seconds(store: ArtifactStore, run_id: str) -> float:
    """The RL loop's training seconds as its committed stages recorded them (rollout and reward
    ``seconds``, the update's ``timing_s/*`` phases), summed over iterations: without validations,
    artifact I/O and orchestration, like the SFT's ``train_seconds``, and the same on a rerun that
    finds the loop committed (this process's wall time would then be ~0)."""
    from stages.floor.locations import iteration_summaries

    total = 0.0
    for stage in ("rollout", "reward"):
        total += sum(float(s.get("seconds", 0.0)) for s in iteration_summaries(store, run_id, stage).values())
    for s in iteration_summaries(store, run_id, "update").values():
        total += sum(float(v) for k, v in s.items() if k.startswith("timing_s/"))
    return total


def control_epochs(epochs: int, sft_s: float, rl_train_s: float) -> int:
    """SFT epochs of the control: ``E + ceil(E · rl_train_s / sft_s)``, the shared SFT's ``E`` epochs
    (``sft_s`` seconds) plus as many as the RL loop's training seconds buy at the same pace."""
    return epochs + math.ceil(epochs * rl_train_s / max(sft_s, 1e-9))


def update_diagnostics(store: ArtifactStore, run_id: str) -> dict[int, dict[str, float]]:
    """``{iteration: {short name: value}}`` of the :data:`DIAGNOSTICS` in the run's update summaries."""
    from stages.floor.locations import iteration_summaries

    return {
        it: {short: float(s[key]) for key, short in DIAGNOSTICS.items() if key in s}
        for it, s in iteration_summaries(store, run_id, "update").items()
    }


def print_diagnostics(store: ArtifactStore, run_id: str) -> None:
    """One line per RL iteration of the run's update metrics (a flat run explains itself here)."""
    rows = update_diagnostics(store, run_id)
    names = list(dict.fromkeys(k for r in rows.values() for k in r))
    print(f"{run_id} per iteration:\n{'it':>4} " + " ".join(f"{n:>9}" for n in names))
    for it, r in rows.items():
        print(f"{it:>4} " + " ".join(f"{r[n]:>9.4g}" if n in r else f"{'-':>9}" for n in names))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=None, help="pipeline configs to compare")
    p.add_argument(
        "--tools", action="store_true", help="the tool-use quickstart; also report tool-call rates"
    )
    p.add_argument("--sharpen", action="store_true", help="quickstart_sharpen (complete demonstrations)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--store", default=None, help="artifact store (default: a temporary directory)")
    p.add_argument(
        "--variants", nargs="+", default=None, help="NAME:key=v,key=v … RL variants on a shared SFT"
    )
    p.add_argument("--baseline", default=None, help="variant the others are checked against (default: first)")
    p.add_argument("--pairs", nargs="+", default=[], help="VARIANT=BASELINE: also check against this one")
    p.add_argument(
        "--diagnostics", action="store_true", help="with --variants: per-iteration update metrics per run"
    )
    p.add_argument(
        "--sft-control",
        action="store_true",
        help="with --variants: per seed also SFT alone, longer by the RL loop's training time",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    args = p.parse_args()

    from flows.pipeline import rlhf_pipeline
    from verl_core.config import load_config
    from verl_core.store import ArtifactStore

    configs = args.configs or (
        TOOLS_CONFIGS if args.tools else SHARPEN_CONFIGS if args.sharpen else DEFAULT_CONFIGS
    )
    root = args.store or tempfile.mkdtemp(prefix="verl-flow-learning-")
    if args.sharpen and not args.variants:  # issue 19's table: GRPO and PPO on one SFT, and the control
        args.variants, args.sft_control = list(SHARPEN_VARIANTS), True
    if args.variants:
        variants = parse_variants(args.variants)
        if any("=" not in pair for pair in args.pairs):
            raise SystemExit("--pairs: write VARIANT=BASELINE")
        pairs = {v: ref for v, _, ref in (pair.partition("=") for pair in args.pairs)}
        names = {v.name for v in variants}
        unknown = ({args.baseline} - {None}) | set(pairs) | set(pairs.values())
        if unknown - names:
            raise SystemExit(f"--baseline/--pairs name no variant: {sorted(unknown - names)}")
        vrows, controls, failed = run_variants(
            configs, args.seeds, variants, root, args.overrides, args.diagnostics, args.sft_control
        )
        print(f"\nstore: {root}")
        print_variants(vrows, args.baseline or variants[0].name, pairs)
        if args.sft_control:
            print_sharpening(vrows, controls)
        for line in failed:
            print(f"FAILED {line}")
        return
    rows: list[tuple[str, int, float, float, float, float]] = []
    tool_rows: list[tuple[str, int, float, float, float, float]] = []
    pass_rows: list[tuple[str, int, int, float, float, float, float]] = []
    for config in configs:
        for seed in args.seeds:
            overrides = [
                f"store.url={root}",
                f"data.seed={seed}",
                f"trainer.seed={seed}",
                f"rollout.seed={seed}",
                *args.overrides,
            ]
            cfg = load_config(str(REPO / config), overrides)
            run_id = f"learning-{Path(config).stem}-seed{seed}"
            t0 = time.perf_counter()
            result = rlhf_pipeline(config=cfg, run_id=run_id)
            wall = time.perf_counter() - t0
            acc = dict(result.val_accuracy)
            first, last = min(acc), max(acc)
            if first != 0:
                raise SystemExit(f"{run_id}: no validation of the SFT checkpoint (trainer.val_before_train)")
            rows.append((Path(config).stem, seed, acc[first], acc[last], acc[last] - acc[first], wall))
            print(
                f"{run_id}: SFT {acc[first]:.3f} → RL {acc[last]:.3f} ({acc[last] - acc[first]:+.3f}) "
                f"after {last} iterations, {wall:.0f} s",
                flush=True,
            )
            passes = report_passes(ArtifactStore(cfg.store.url), run_id)
            if passes is not None:
                pass_rows.append((Path(config).stem, seed, *passes))
            if args.tools:
                rates = tool_call_rates(ArtifactStore(cfg.store.url), run_id)
                tool_rows.append((Path(config).stem, seed, *rates))
                print(
                    f"{run_id}: tool-call rate, rollouts first 3 {rates[0]:.3f} → last 3 {rates[1]:.3f}; "
                    f"greedy validation SFT {rates[2]:.3f} → RL {rates[3]:.3f}",
                    flush=True,
                )

    print(f"\nstore: {root}")
    print(f"{'config':<18} {'seed':>4} {'SFT':>6} {'RL':>6} {'gain':>7} {'wall s':>7}")
    for name, seed, sft, rl, gain, wall in rows:
        print(f"{name:<18} {seed:>4} {sft:>6.3f} {rl:>6.3f} {gain:>+7.3f} {wall:>7.0f}")
    for name in dict.fromkeys(r[0] for r in rows):
        gains = [r[4] for r in rows if r[0] == name]
        target = TARGET_GAIN.get(name, 0.15)
        print(
            f"{name}: gain mean {statistics.mean(gains):+.3f}, min {min(gains):+.3f} over {len(gains)} seeds"
            f" ({'meets' if min(gains) >= target else 'misses'} the +{target:.2f} target)"
        )
    if pass_rows:
        print(
            f"\n{'config':<18} {'seed':>4} {'k':>2} {'p@1 SFT':>7} {'p@1 RL':>6} {'p@k SFT':>7} {'p@k RL':>6}"
        )
        for name, seed, k, p1_sft, p1_rl, pk_sft, pk_rl in pass_rows:
            print(f"{name:<18} {seed:>4} {k:>2} {p1_sft:>7.3f} {p1_rl:>6.3f} {pk_sft:>7.3f} {pk_rl:>6.3f}")
    if tool_rows:
        print(f"\n{'config':<18} {'seed':>4} {'rate first3':>11} {'last3':>6} {'val SFT':>7} {'val RL':>6}")
        for name, seed, first3, last3, val0, val1 in tool_rows:
            print(f"{name:<18} {seed:>4} {first3:>11.3f} {last3:>6.3f} {val0:>7.3f} {val1:>6.3f}")
        rising = all(r[3] > r[2] for r in tool_rows)
        print(f"tool-call rate: last 3 above first 3 on {'every' if rising else 'not every'} seed")


if __name__ == "__main__":
    main()
