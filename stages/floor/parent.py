"""Forks and replays: runs that start from another run's checkpoint (the config's ``parent`` section).

A **fork** (``verl-flow run CONFIG --fork RUN@ITER``) starts from the parent's committed
``ckpt/iter-ITER`` (policy, critic, optimizer and scheduler states, KL controller, RNG, prompt cursor:
what a resume restores) with its own config, and samples its own rollouts from there. Its reference
policy is the parent's (the root run's SFT policy, or its initial model), so a fork with the parent's
config makes exactly the parent's next updates.

A **replay** (``verl-flow replay RUN --from ITER``) is a fork with the parent's config (+ overrides of
how updates are made) whose iterations ITER.. train on the parent's stored rollouts and rewards (or a
rescore's rewards) instead of sampling: :func:`replay_sources`. What may change:
:func:`check_replay_overrides`. With the parent's settings it reproduces the parent's checkpoints bit
for bit. With others it is off-policy after its first update: the stored behaviour log-probs are the
behaviour policy, and ``algorithm.rollout_correction`` applies as the replay's config says, by
default as the parent's (importance weights or rejection on only if the parent had them: turning
them on by default would change even an unchanged replay). The mismatch of π_old against the
behaviour log-probs (``rollout_corr/kl``, ``k3_kl``, ``log_prob_abs_diff_*``) is measured and logged
every iteration either way (update manifest summary, tracker).

The family of a run (parents up the chain, forks and replays down) is read from the run records of
the store: :func:`read_family`, :func:`family_tree`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from stages.floor.locations import (
    ckpt_stage,
    iteration_stage,
    list_checkpoints,
    rescore_stage,
)
from verl_core.config import ModelConfig, ParentConfig, VerlFlowConfig, apply_override, validate_config
from verl_core.errors import ArtifactNotFoundError, ConfigError, VerlFlowError
from verl_core.store import ArtifactStore, Manifest

SFT_STAGE = "sft"
_SPEC = re.compile(r"^(?P<run>[^@\s]+)@(?P<it>\d+)$")

# What a replay may change: how updates are made, and where/how the run goes on; never what the
# stored rollouts came from (data, model, tokenizer, rollout sampling, reward).
REPLAYABLE_SECTIONS = ("algorithm", "actor", "critic", "ref", "export", "eval", "tracking", "execution")
REPLAYABLE_TRAINER = (
    "test_freq", "val_before_train", "save_freq", "max_ckpt_to_keep", "resume_mode", "device",
    "project_name", "experiment_name",
)  # fmt: skip
NOT_REPLAYABLE = ("algorithm.filter_groups",)  # dynamic sampling picks generation batches: sampling


def parse_parent_spec(text: str) -> tuple[str, int]:
    """``"left@10"`` → ``("left", 10)``; anything else is a one-line ConfigError."""
    m = _SPEC.match(text.strip())
    if m is None or int(m.group("it")) < 1:
        raise ConfigError(
            f"--fork: got {text!r}, expected RUN_ID@ITERATION (a checkpoint after >= 1 updates)"
        )
    return m.group("run"), int(m.group("it"))


def parent_overrides(run_id: str, iteration: int) -> list[str]:
    """The dotted overrides that make a config a fork of ``run_id`` at ``iteration``."""
    return [f"parent.run_id={run_id}", f"parent.iteration={iteration}"]


def check_replay_overrides(overrides: Sequence[str]) -> None:
    """One-line ConfigError naming the first override a replay cannot honour: the stored rollouts fix
    ``data.*``, ``model.*``, ``rollout.*``, ``reward.*`` (and the seeds that sampled them)."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        section, _, field = key.partition(".")
        ok = section in REPLAYABLE_SECTIONS or (section == "trainer" and field in REPLAYABLE_TRAINER)
        if ok and not any(key == n or key.startswith(f"{n}.") for n in NOT_REPLAYABLE):
            continue
        hint = (
            "; for other rewards rescore the run (verl-flow rescore) and replay with --rewards NAME"
            if section in ("reward", "sandbox")
            else ""
        )
        raise ConfigError(
            f"{key or item!r}: a replay trains on the parent's stored rollouts and rewards, which fix this "
            f"setting; it changes only {', '.join(f'{s}.*' for s in REPLAYABLE_SECTIONS)} and "
            f"trainer.{{{','.join(REPLAYABLE_TRAINER)}}}{hint}"
        )


def replay_config(
    store: ArtifactStore, run_id: str, iteration: int, overrides: Sequence[str], rewards: str | None
) -> VerlFlowConfig:
    """The config of a replay of ``run_id`` from ``iteration``: the parent's recorded config with
    ``overrides`` (:func:`check_replay_overrides`) and the ``parent`` section; in this store."""
    check_replay_overrides(overrides)
    parent_cfg = run_config(store, run_id)
    raw = parent_cfg.model_dump(mode="json")
    raw["store"] = {**raw["store"], "url": store.url}
    for item in overrides:
        apply_override(raw, item)
    raw["parent"] = {"run_id": run_id, "iteration": iteration, "replay": True, "rewards": rewards}
    cfg = validate_config(raw)
    if cfg.algorithm.greedy_baseline != parent_cfg.algorithm.greedy_baseline:
        raise ConfigError(
            f"algorithm.adv_estimator: {cfg.algorithm.adv_estimator} and the parent's "
            f"{parent_cfg.algorithm.adv_estimator} differ in ReMax's greedy baseline rollouts, which a "
            "replay cannot add or drop"
        )
    return cfg


def replay_run_id(parent: str, iteration: int, config_hash: str) -> str:
    """``left-replay10-1a2b3c4d``: the default run id of a replay; the same replay command resumes it."""
    return f"{parent}-replay{iteration}-{config_hash[:8]}"


def run_config(store: ArtifactStore, run_id: str) -> VerlFlowConfig:
    """The recorded config of ``run_id`` (its ``run.json``); a missing run is one line listing the runs."""
    try:
        record = store.read_run_record(run_id)
    except (FileNotFoundError, VerlFlowError):
        runs = store.list_runs()
        raise ArtifactNotFoundError(
            f"parent.run_id: no run {run_id!r} in {store.url} (runs: {', '.join(runs) or 'none'})"
        ) from None
    return validate_config(record.config)


FORK_START = "fork_start"  # summary key of a fork's own checkpoints: the identity it started from


class ForkStart(NamedTuple):
    """Where a fork starts: the parent's checkpoint, its identity in the new policy lineage, and the
    reference policy of the family (the root run's SFT policy, or its initial model)."""

    checkpoint: Manifest | None  # None: pruned since, the fork resumes from its own checkpoint
    identity: str  # the start of the fork's policy lineage (stages.floor.lineage.policy_lineage)
    reference_sft: Manifest | None  # None: the root's initial model (reference_model, reference_seed)
    reference_model: ModelConfig
    reference_seed: int


def fork_start(store: ArtifactStore, parent: ParentConfig, resumed: Manifest | None = None) -> ForkStart:
    """The parent's committed ``ckpt/iter-{parent.iteration}``; a missing run or checkpoint (never
    saved, or pruned by ``trainer.max_ckpt_to_keep``) is one line listing the iterations there are.
    ``resumed``: the fork's own checkpoint it resumes from, which records the start
    (:data:`FORK_START`): then the parent's checkpoint may be gone."""
    run_config(store, parent.run_id)  # a missing run: one line
    ckpt = store.committed(parent.run_id, ckpt_stage(parent.iteration))
    if ckpt is None and resumed is not None and FORK_START in resumed.summary:
        return _with_reference(store, parent, None, str(resumed.summary[FORK_START]))
    if ckpt is None:
        have = list_checkpoints(store, parent.run_id)
        raise ArtifactNotFoundError(
            f"parent.iteration: run {parent.run_id!r} has no checkpoint at iteration {parent.iteration} "
            f"(available: {', '.join(map(str, have)) or 'none'}; older ones are pruned by "
            "trainer.max_ckpt_to_keep)"
        )
    identity = store.manifest_sha256(store.manifest_uri(parent.run_id, ckpt.stage))
    if parent.replay:  # a replay's trajectory also depends on the data it reads
        identity += f"+replay:{parent.rewards or 'own-rewards'}"
    return _with_reference(store, parent, ckpt, identity)


def _with_reference(
    store: ArtifactStore, parent: ParentConfig, ckpt: Manifest | None, identity: str
) -> ForkStart:
    root = _root(store, parent.run_id)
    root_cfg = run_config(store, root)
    sft = store.committed(root, SFT_STAGE) if root_cfg.sft.enable else None
    return ForkStart(ckpt, identity, sft, root_cfg.model, root_cfg.trainer.seed)


def _root(store: ArtifactStore, run_id: str) -> str:
    """The first run up the parent chain of ``run_id`` that has no parent."""
    seen = {run_id}
    cfg = run_config(store, run_id)
    while cfg.parent is not None:
        run_id = cfg.parent.run_id
        if run_id in seen:
            raise ConfigError(f"parent.run_id: the parent chain of run {run_id!r} loops")
        seen.add(run_id)
        cfg = run_config(store, run_id)
    return run_id


def replay_sources(store: ArtifactStore, parent: ParentConfig, iteration: int) -> tuple[str, str]:
    """(rollout, reward) manifest URIs of the parent's iteration ``iteration`` that a replay trains on:
    its own reward stage, or ``rescore/{parent.rewards}/iter-XXXX/reward``. One line when missing."""
    run = parent.run_id
    rollout, reward = iteration_stage(iteration, "rollout"), iteration_stage(iteration, "reward")
    if parent.rewards is not None:
        reward = rescore_stage(parent.rewards, reward)
    for stage in (rollout, reward):
        if store.committed(run, stage) is None:
            raise ArtifactNotFoundError(
                f"replay: run {run!r} has no committed {stage} for iteration {iteration}"
                + (" (the rescore did not cover it)" if stage.startswith("rescore/") else "")
            )
    return store.manifest_uri(run, rollout), store.manifest_uri(run, reward)


def check_parent(store: ArtifactStore, cfg: VerlFlowConfig, run_id: str | None = None) -> None:
    """Before any work: a fork's parent checkpoint (unless run ``run_id`` resumes from a checkpoint
    of its own), and a replay's stored rollouts and rewards of every iteration it has still to train
    (nothing to check without a parent)."""
    p = cfg.parent
    if p is None:
        return
    own = list_checkpoints(store, run_id) if run_id is not None else []
    resumed = store.committed(str(run_id), ckpt_stage(own[-1])) if own else None
    fork_start(store, p, resumed)
    if p.replay:
        for it in range(max([p.iteration, *own]), cfg.trainer.total_iterations):
            replay_sources(store, p, it)


# --------------------------------------------------------------------------------------------------
# The family of a run


class RunLink(NamedTuple):
    """A run's link to its parent, as its run record holds it."""

    run_id: str
    parent: str | None
    iteration: int | None
    kind: str  # "run" | "fork" | "replay"
    rewards: str | None


def run_link(run_id: str, config: Mapping[str, object]) -> RunLink:
    """The link of a run from its recorded config (``parent`` section, absent or null: none)."""
    p = config.get("parent")
    if not isinstance(p, Mapping):
        return RunLink(run_id, None, None, "run", None)
    kind = "replay" if p.get("replay") else "fork"
    rewards = p.get("rewards")
    return RunLink(
        run_id, str(p["run_id"]), int(str(p["iteration"])), kind, None if rewards is None else str(rewards)
    )


def read_family(store: ArtifactStore) -> dict[str, RunLink]:
    """Every run of the store with its link (run records that do not read are left out)."""
    out = {}
    for run_id in store.list_runs():
        try:
            out[run_id] = run_link(run_id, store.read_run_record(run_id).config)
        except VerlFlowError:
            continue
    return out


class FamilyTree(NamedTuple):
    """``ancestors``: the parent chain, nearest first; ``descendants``: (depth, link) in depth-first
    order (depth 1: a fork or replay of the run itself)."""

    run: RunLink
    ancestors: list[RunLink]
    descendants: list[tuple[int, RunLink]]


def family_tree(links: Mapping[str, RunLink], run_id: str) -> FamilyTree:
    """The family of ``run_id`` among ``links`` (:func:`read_family`); a parent not in the store ends
    the chain with a link of kind "missing"."""
    me = links.get(run_id) or RunLink(run_id, None, None, "run", None)
    ancestors, seen, node = [], {run_id}, me
    while node.parent is not None and node.parent not in seen:
        seen.add(node.parent)
        node = links.get(node.parent) or RunLink(node.parent, None, None, "missing", None)
        ancestors.append(node)
    children: dict[str, list[RunLink]] = {}
    for link in sorted(links.values(), key=lambda r: (r.iteration or 0, r.run_id)):
        if link.parent is not None:
            children.setdefault(link.parent, []).append(link)
    descendants: list[tuple[int, RunLink]] = []

    def walk(parent: str, depth: int) -> None:
        for child in children.get(parent, []):
            if child.run_id not in seen:
                seen.add(child.run_id)
                descendants.append((depth, child))
                walk(child.run_id, depth + 1)

    walk(run_id, 1)
    return FamilyTree(me, ancestors, descendants)
