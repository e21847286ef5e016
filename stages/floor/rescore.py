"""What ``verl-flow rescore`` stands on: which settings may change, the plan (name, reward config hash,
the stored rollouts to score again), the lease of one rescore, and its report read back for flows.

A rescore of run R named N writes ``rescore/N/{stage}`` beside every rescored stage of R and
``rescore/N/report``; R's own stages are only read. N defaults to the first 8 hex digits of the
reward config hash (:func:`reward_config_hash`), and one N holds one reward config: a second rescore
under N with other settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict

from stages.floor.locations import (
    RESCORE,
    RescoreTarget,
    check_rescore_name,
    parse_rescore_stage,
    rescore_report_stage,
    rescore_targets,
)
from verl_core.config import RewardConfig, SandboxConfig, VerlFlowConfig, with_overrides
from verl_core.config.loader import is_our_key
from verl_core.config.verl_translate import translate
from verl_core.errors import ArtifactNotFoundError, ConfigError
from verl_core.reward.compare import RewardComparison
from verl_core.store import ArtifactStore, Manifest
from verl_core.store.lease import RunInUseError, RunLease

RESCORABLE = ("reward", "sandbox")  # the config sections a rescore may change
_ITERATIONS = re.compile(r"^\s*(\d*)\s*(:?)\s*(\d*)\s*$")


def check_rescore_overrides(overrides: Sequence[str]) -> list[str]:
    """One-line ConfigError for an override of anything but ``reward.*`` and ``sandbox.*``, judged on
    the keys the overrides set once verl's names are translated (``custom_reward_function.path`` sets
    ``reward.function``). Returns the translation lines (``verl key X → Y``); a verl key the table
    drops is left to :func:`rescore_settings`' error (it says why, and what to use instead)."""
    pairs = [(key.strip(), text) for key, _, text in (item.partition("=") for item in overrides)]
    settings, made, unknown = translate(pairs, is_our_key)
    for key in [k for k, _ in settings] + unknown:
        if key.split(".", 1)[0] not in RESCORABLE:
            raise ConfigError(
                f"{key!r}: a rescore changes only reward.* and sandbox.* settings (the rollouts "
                "are the run's own)"
            )
    return [t.line() for t in made if not t.dropped]


def rescore_settings(cfg: VerlFlowConfig, overrides: Sequence[str]) -> VerlFlowConfig:
    """The run's config ``cfg`` with ``overrides`` (:func:`check_rescore_overrides`) applied."""
    check_rescore_overrides(overrides)
    return with_overrides(cfg, overrides)


def parse_iterations(text: str) -> tuple[int, int | None]:
    """``"A:B"`` → ``(A, B)``: iterations A ≤ i < B; ``"A:"`` → ``(A, None)``; ``":B"`` → ``(0, B)``;
    ``"N"`` → ``(N, N + 1)``. Anything else is a one-line ConfigError."""
    m = _ITERATIONS.match(text)
    if m and (m.group(1) or m.group(3)):
        first = int(m.group(1)) if m.group(1) else 0
        if not m.group(2):
            return first, first + 1
        stop = int(m.group(3)) if m.group(3) else None
        if stop is None or stop > first:
            return first, stop
    raise ConfigError(f"--iterations: got {text!r}, expected A:B (iterations A <= i < B), A:, :B or N")


def reward_params(reward: RewardConfig, sandbox: SandboxConfig) -> dict[str, Any]:
    """The settings rescored rewards depend on: ``reward.*``, and ``sandbox.*`` when the code scorer runs."""
    params: dict[str, Any] = {"reward": reward.model_dump(mode="json")}
    if any(s.name == "code" for s in reward.scorers):
        params["sandbox"] = sandbox.model_dump(mode="json")
    return params


def reward_config_hash(reward: RewardConfig, sandbox: SandboxConfig) -> str:
    """sha256 of :func:`reward_params` (canonical JSON)."""
    return hashlib.sha256(json.dumps(reward_params(reward, sandbox), sort_keys=True).encode()).hexdigest()


class RescorePlan(NamedTuple):
    """One rescore: its name, the reward config hash, the overrides as given, the stages to rescore."""

    name: str
    reward_config_hash: str
    overrides: tuple[str, ...]
    targets: tuple[RescoreTarget, ...]


def plan_rescore(
    store: ArtifactStore,
    run_id: str,
    new: VerlFlowConfig,
    overrides: Sequence[str],
    name: str | None,
    iterations: str | None,
) -> RescorePlan:
    """The rescore of ``run_id``'s stored rollouts with ``new.reward`` (and ``new.sandbox``): refuses a
    ``name`` already used with another reward config, and a run with no stored rollouts in range."""
    config_hash = reward_config_hash(new.reward, new.sandbox)
    name = check_rescore_name(name or config_hash[:8])
    span = parse_iterations(iterations) if iterations is not None else None
    manifests = store.list_manifests(run_id)
    for m in manifests:
        parsed = parse_rescore_stage(m.stage)
        used = m.summary.get("reward_config_hash")
        if parsed is not None and parsed[0] == name and used not in (None, config_hash):
            raise ConfigError(
                f"--name {name}: rescore {name!r} of run {run_id!r} holds reward config {used[:12]}, these "
                f"settings are {config_hash[:12]}: give another --name (default: the config's hash)"
            )
    targets = rescore_targets(store, run_id, manifests, span)
    if not targets:
        where = f" in iterations {iterations}" if iterations is not None else ""
        raise ArtifactNotFoundError(f"run {run_id!r} has no committed rewards to rescore{where}")
    return RescorePlan(name, config_hash, tuple(overrides), tuple(targets))


@contextmanager
def rescore_lease(store: ArtifactStore, run_id: str, name: str, ttl_s: float) -> Iterator[None]:
    """Hold the lease of rescore ``name`` of ``run_id`` (``rescore/{name}/lease.json``): one process
    writes a rescore at a time, while the run itself (its own lease) may go on."""
    lease = RunLease(store, run_id, ttl_s, name=f"{RESCORE}/{check_rescore_name(name)}/lease.json")
    try:
        lease.acquire()
    except RunInUseError:
        holder = lease.read()
        who = holder.describe() if holder else "another process"
        raise RunInUseError(f"rescore {name!r} of run {run_id!r} is being written by {who}") from None
    try:
        yield
    finally:
        lease.release()


# --------------------------------------------------------------------------------------------------
# The report, as committed (manifest summary of rescore/{name}/report) and read back


class ComparisonRow(BaseModel):
    """Old vs new rewards of one rescored table (a row of ``comparison.parquet``, kind
    "reward_comparison"), or of all of them (``source`` "all")."""

    model_config = ConfigDict(frozen=True)

    source: str  # the original stage, and the table within it: iter-0003/val/sampled, eval/x/greedy
    split: str  # train | val | val/sampled | eval/greedy | eval/sampled | all
    iteration: int  # -1: eval, or all
    rows: int
    score_old_mean: float
    score_new_mean: float
    accuracy_old: float
    accuracy_new: float
    agreement: float
    tt: int
    tf: int
    ft: int
    ff: int
    scores_changed: int

    @classmethod
    def of(cls, source: str, split: str, iteration: int, c: RewardComparison) -> ComparisonRow:
        fields = c._asdict()
        confusion = fields.pop("confusion")._asdict()
        return cls(source=source, split=split, iteration=iteration, **fields, **confusion)


class RescoreReport(BaseModel):
    """What a rescore found (the summary of ``rescore/{name}/report`` and its ``report.json``).

    ``scoring_s``: seconds the rescore spent scoring (every table), ``train_scoring_s`` of that on the
    training rollouts; ``original_s``: the run's own rollout + reward seconds of those training
    iterations, for comparison."""

    model_config = ConfigDict(frozen=True)

    name: str
    reward_config_hash: str
    overrides: list[str]
    parts: list[ComparisonRow]
    total: ComparisonRow
    scoring_s: float
    train_scoring_s: float
    original_s: float
    plots: list[str]


def read_rescore_report(store: ArtifactStore, report_uri: str) -> RescoreReport:
    return RescoreReport.model_validate(store.read_manifest(report_uri).summary)


class RescoreListing(NamedTuple):
    """A rescore of a run as ``verl-flow runs show`` lists it."""

    name: str
    reward_config_hash: str
    stages: int  # rescored stages committed
    report: Manifest | None  # None: not finished


def list_rescores(manifests: Sequence[Manifest]) -> list[RescoreListing]:
    """The rescores among a run's committed ``manifests``, in order of their first commit."""
    found: dict[str, list[Manifest]] = {}
    for m in manifests:
        parsed = parse_rescore_stage(m.stage)
        if parsed is not None:
            found.setdefault(parsed[0], []).append(m)
    out = []
    for name, ms in found.items():
        report = next((m for m in ms if m.stage == rescore_report_stage(name)), None)
        units = [m for m in ms if m is not report]
        config_hash = str((units or ms)[0].summary.get("reward_config_hash", ""))
        out.append(RescoreListing(name, config_hash, len(units), report))
    return out


def is_rescore(manifest: Manifest) -> bool:
    return parse_rescore_stage(manifest.stage) is not None
