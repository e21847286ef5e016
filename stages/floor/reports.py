"""What the eval and report stages commit, read back by flows (the CLI, the run's Prefect artifacts):
the eval report as a typed model, its greedy samples, and a run's per-iteration metric series with
their markdown table.

The eval stage writes :meth:`EvalReport.summary` as its manifest summary and ``report.json``; the
report stage renders :func:`collect_series` and :func:`metrics_markdown`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from stages.floor.locations import parse_generation_stage, parse_iteration_stage
from verl_core.runtime.run_length import StepCount
from verl_core.store import ArtifactStore

# --------------------------------------------------------------------------------------------------
# Eval report and samples


class SourceReport(BaseModel):
    """Eval figures of one data source."""

    model_config = ConfigDict(frozen=True)

    prompts: int
    accuracy: float  # greedy
    pass_at_k: float | None = None  # of the sampled pass (eval.k > 1)


class EvalReport(BaseModel):
    """What an eval stage found: greedy accuracy (mean over prompts of the fraction of correct
    responses, validation's rule), and with ``k`` > 1 pass@1 and pass@k of ``k`` samples per prompt;
    overall and per data source."""

    model_config = ConfigDict(frozen=True)

    source: str  # label of the evaluated policy (the stage is eval/{source})
    prompts: int
    accuracy: float
    k: int
    pass_at_1: float | None = None
    pass_at_k: float | None = None
    by_source: dict[str, SourceReport]

    def summary(self) -> dict[str, Any]:
        """The committed form (manifest summary, ``report.json``): pass@k keys spelled ``pass@{k}``."""
        pk = f"pass@{self.k}"
        by_source = {}
        for name, s in self.by_source.items():
            by_source[name] = {"prompts": s.prompts, "accuracy": s.accuracy}
            if s.pass_at_k is not None:
                by_source[name][pk] = s.pass_at_k
        out: dict[str, Any] = {
            "source": self.source,
            "prompts": self.prompts,
            "accuracy": self.accuracy,
            "k": self.k,
            "by_source": by_source,
        }
        if self.pass_at_1 is not None:
            out["pass@1"] = self.pass_at_1
        if self.pass_at_k is not None:
            out[pk] = self.pass_at_k
        return out

    @classmethod
    def from_summary(cls, summary: Mapping[str, Any]) -> EvalReport:
        """Inverse of :meth:`summary`."""
        pk = f"pass@{summary['k']}"
        return cls(
            source=summary["source"],
            prompts=summary["prompts"],
            accuracy=summary["accuracy"],
            k=summary["k"],
            pass_at_1=summary.get("pass@1"),
            pass_at_k=summary.get(pk),
            by_source={
                name: SourceReport(prompts=s["prompts"], accuracy=s["accuracy"], pass_at_k=s.get(pk))
                for name, s in summary["by_source"].items()
            },
        )


def read_eval_report(store: ArtifactStore, eval_uri: str) -> EvalReport:
    """The report of the committed eval stage at ``eval_uri``."""
    return EvalReport.from_summary(store.read_manifest(eval_uri).summary)


class EvalSample(NamedTuple):
    """One greedy eval sample (a row of the Prefect table artifact, a line of ``verl-flow eval``)."""

    data_source: str
    prompt: str
    response: str
    extracted: str | None  # the answer a rule scorer extracted (None: none found, or no rule scorer)
    ground_truth: str
    correct: bool
    score: float


def eval_samples(store: ArtifactStore, eval_uri: str, limit: int) -> list[EvalSample]:
    """The first ``limit`` greedy samples of the committed eval stage at ``eval_uri``."""
    m = store.read_manifest(eval_uri)
    r = store.read_table(m, "greedy/rollouts.parquet").slice(0, limit)
    w = store.read_table(m, "greedy/rewards.parquet").slice(0, limit)
    columns = zip(
        r.column("data_source").to_pylist(),
        r.column("prompt_text").to_pylist(),
        r.column("response_text").to_pylist(),
        w.column("extracted_answer").to_pylist(),
        r.column("ground_truth").to_pylist(),
        w.column("correct").to_pylist(),
        w.column("score").to_pylist(),
        strict=True,
    )
    return [EvalSample(*row) for row in columns]


# --------------------------------------------------------------------------------------------------
# Per-iteration metric series

# (series, column label) of the per-iteration metrics table
TABLE_COLUMNS = [
    ("critic/score/mean", "reward"),
    ("reward/accuracy", "train acc"),
    ("val/accuracy", "val acc"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/entropy", "entropy"),
    ("response_length/mean", "resp len"),
    ("iteration_s", "seconds"),
]


def collect_series(store: ArtifactStore, run_id: str) -> dict[str, dict[int, float]]:
    """``{metric: {iteration: value}}`` from the committed per-iteration manifests. ``iteration_s`` is
    the summed time of the iteration's rollout, reward and update phases."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    # dynamic sampling: an iteration's generation batches (gen-K) combine, reward figures weighted by rows
    weighted: dict[tuple[str, int], float] = defaultdict(float)
    rows: dict[tuple[str, int], float] = defaultdict(float)
    for m in store.list_manifests(run_id):
        parsed = parse_iteration_stage(m.stage)
        gen = parse_generation_stage(m.stage)
        if parsed is None and gen is None:
            continue
        it, kind = parsed if parsed is not None else gen[:2]  # type: ignore[index]
        summary = m.summary
        values: Mapping[str, Any] = summary.get("metrics", summary) if kind == "reward" else summary
        n = float(summary.get("rows", 1)) if gen is not None else 1.0
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "/" in key:
                if kind == "reward" and key.startswith(("critic/", "response_length/")):
                    continue  # the update stage reports the same batch figures
                if gen is None:
                    series[key][it] = float(value)
                elif not key.startswith("timing_s/"):
                    weighted[(key, it)] += float(value) * n
                    rows[(key, it)] += n
        if kind == "rollout":
            seconds = float(summary.get("seconds", 0.0))
            series["timing_s/rollout"][it] = series["timing_s/rollout"].get(it, 0.0) + seconds
    for (key, it), total in weighted.items():
        series[key][it] = total / rows[(key, it)]
    for it in set(series.get("timing_s/rollout", {})) | set(series.get("timing_s/update_actor", {})):
        series["iteration_s"][it] = sum(
            v[it] for k, v in series.items() if k.startswith("timing_s/") and "validate" not in k and it in v
        )
    return dict(series)


def metrics_markdown(series: Mapping[str, Mapping[int, float]]) -> str:
    """The per-iteration metrics table (markdown); columns the run does not have are left out."""
    cols = [(k, label) for k, label in TABLE_COLUMNS if series.get(k)]
    iterations = sorted({it for k, _ in cols for it in series[k]})
    lines = [
        "| iteration | " + " | ".join(label for _, label in cols) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for it in iterations:
        cells = [f"{series[k][it]:.4g}" if it in series[k] else "" for k, _ in cols]
        lines.append(f"| {it} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sft_step_count(store: ArtifactStore, sft_uri: str) -> StepCount:
    """Planned vs completed optimizer steps the SFT stage committed."""
    return StepCount.model_validate(store.read_manifest(sft_uri).summary["step_count"])
