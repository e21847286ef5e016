"""A run's policy lineage and what its RL loop leaves: the identity of the policy trajectory (the
starting weights and every setting that shapes the policy), the loop's result, and that result rebuilt
from the store after the loop ran elsewhere."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from stages.floor.locations import ckpt_stage, list_checkpoints, validations
from stages.floor.parent import ForkStart, fork_start
from stages.floor.specs import iteration_count
from verl_core.config import VerlFlowConfig, canonical_json
from verl_core.runtime.run_length import StepCount
from verl_core.store import ArtifactStore


def start_identity(store: ArtifactStore, sft_uri: str | None, fork: ForkStart | None) -> str | None:
    """The start of a run's policy lineage: a fork's parent checkpoint (:class:`ForkStart`), else the
    SFT manifest's hash, else None (the initial model)."""
    if fork is not None:
        return fork.identity
    return store.manifest_sha256(sft_uri) if sft_uri else None


def policy_lineage(cfg: VerlFlowConfig, start_sha: str | None) -> str:
    """Identity of the policy trajectory: the starting weights (SFT manifest hash, or the initial
    model) and every setting that changes what the policy becomes. Iteration i's policy is a function
    of this and i (fixed seeds), so stages keyed by (lineage, i) can be skipped on rerun."""
    shaping = {
        k: cfg.section_without_placement(k)
        for k in ("data", "model", "actor", "critic", "ref", "rollout", "reward", "algorithm")
    }
    shaping["trainer"] = {
        "seed": cfg.trainer.seed,
        "critic_warmup": cfg.trainer.critic_warmup,
        "total_iterations": cfg.trainer.total_iterations,
        "total_epochs": cfg.trainer.total_epochs,  # caps the iterations, sets the LR schedule
    }
    if cfg.trainer.rollout_ahead:  # which policy samples each batch (absent when 0: older lineages hold)
        shaping["trainer"]["rollout_ahead"] = cfg.trainer.rollout_ahead
    shaping["start"] = start_sha or "initial-model"
    return hashlib.sha256(canonical_json(shaping).encode()).hexdigest()


@dataclass(frozen=True)
class RLResult:
    """What the RL loop leaves: its last checkpoint's manifest URI, the held-out accuracy of the
    policy after each validated iteration (0: before RL), and seconds spent per phase."""

    checkpoint: str
    val_accuracy: dict[int, float]
    iterations: StepCount  # planned vs completed
    timing_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (how an SPMD job's rank 0 hands it to the launching flow)."""
        val = {str(k): v for k, v in self.val_accuracy.items()}
        return {
            "checkpoint": self.checkpoint,
            "val_accuracy": val,
            "timing_s": self.timing_s,
            "iterations": self.iterations.model_dump(mode="json"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RLResult:
        return cls(
            checkpoint=data["checkpoint"],
            val_accuracy={int(k): float(v) for k, v in data["val_accuracy"].items()},
            iterations=StepCount.model_validate(data["iterations"]),
            timing_s={k: float(v) for k, v in data["timing_s"].items()},
        )


def committed_rl_result(
    store: ArtifactStore, run_id: str, cfg: VerlFlowConfig, sft_uri: str | None
) -> RLResult | None:
    """The RL loop's result rebuilt from the store (after its flow ran elsewhere): the last committed
    checkpoint and the validations of this policy lineage; None without a checkpoint. No timings."""
    ckpts = list_checkpoints(store, run_id)
    last = store.committed(run_id, ckpt_stage(ckpts[-1])) if ckpts else None
    if last is None:
        return None
    fork = fork_start(store, cfg.parent, last) if cfg.parent is not None else None
    lineage = policy_lineage(cfg, start_identity(store, sft_uri, fork))
    count = iteration_count(cfg, int(last.summary["planned_iterations"]), ckpts[-1])
    uri = store.manifest_uri(run_id, ckpt_stage(ckpts[-1]))
    return RLResult(uri, validations(store, run_id, lineage), iterations=count)
