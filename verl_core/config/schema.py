"""The schema of a verl-flow run: sections, defaults, one-line descriptions, cross-field checks.

Every default lives in this package (the section modules ``base``, ``model``, ``training``,
``generation``, ``run``) and nowhere else; every field carries a one-line description (shown by
``verl-flow config show`` and rendered by the Prefect UI as the flow's parameters). Section and field
names follow verl where verl has one (``data.train_batch_size``, ``actor.ppo_mini_batch_size``,
``algorithm.adv_estimator``, ``rollout.n`` ...). The defaults are the embedded quickstart: a tiny
model built from scratch on CPU, synthetic arithmetic data, a local artifact store and local MLflow.

The sections live by group (:mod:`.model`, :mod:`.training`, :mod:`.generation`, :mod:`.run`, on the
:class:`~.base.Section` base); this module assembles them into :class:`VerlFlowConfig` and hashes
a config (:func:`config_hash`, the run's identity). The cross-field checks live in :mod:`.preflight`,
which knows the schema by type only (no runtime import back).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import model_validator

from verl_core.config.base import Section, _f
from verl_core.config.gate import GateConfig
from verl_core.config.generation import RewardConfig, RolloutConfig
from verl_core.config.model import DataConfig, ModelConfig
from verl_core.config.run import (
    EvalConfig,
    ExecutionConfig,
    ExportConfig,
    ParentConfig,
    RetrainConfig,
    SandboxConfig,
    StoreConfig,
    TrackingConfig,
    TrainerConfig,
)
from verl_core.config.training import ActorConfig, AlgorithmConfig, CriticConfig, RefConfig, SFTConfig

# Where and how models are placed, not what they compute: left out of the identity of a policy's
# trajectory (a run resumes on another world size or strategy) and of the update stage's inputs.
PLACEMENT_FIELDS: dict[str, set[str]] = {
    "actor": {"strategy", "zero_stage", "param_offload", "tensor_parallel_size"},
    "critic": {"strategy", "zero_stage", "param_offload"},
    "ref": {"strategy", "param_offload"},
    "rollout": {"share_weights"},
}


class VerlFlowConfig(Section):
    """The whole run."""

    data: DataConfig = _f(DataConfig(), "Datasets, lengths, batching")
    model: ModelConfig = _f(ModelConfig(), "Base model, LoRA/QLoRA")
    sft: SFTConfig = _f(SFTConfig(), "SFT warm-up")
    actor: ActorConfig = _f(ActorConfig(), "Policy optimisation")
    critic: CriticConfig = _f(CriticConfig(), "Value model")
    ref: RefConfig = _f(RefConfig(), "Reference policy")
    rollout: RolloutConfig = _f(RolloutConfig(), "Generation")
    reward: RewardConfig = _f(RewardConfig(), "Reward scoring")
    algorithm: AlgorithmConfig = _f(AlgorithmConfig(), "Advantages and KL")
    trainer: TrainerConfig = _f(TrainerConfig(), "The RL loop, checkpoints, seeds")
    store: StoreConfig = _f(StoreConfig(), "Artifact store")
    tracking: TrackingConfig = _f(TrackingConfig(), "Experiment tracking (MLflow, W&B)")
    export: ExportConfig = _f(ExportConfig(), "Merged HF model export and registry")
    retrain: RetrainConfig = _f(RetrainConfig(), "What a scheduled retraining starts from")
    eval: EvalConfig = _f(EvalConfig(), "Evaluation of the exported policy")
    gate: GateConfig = _f(GateConfig(), "Champion/challenger gate after eval, promotion in the registry")
    execution: ExecutionConfig = _f(ExecutionConfig(), "Where stages run")
    sandbox: SandboxConfig = _f(SandboxConfig(), "Untrusted code: the code scorer and the python tool")
    parent: ParentConfig | None = _f(
        None, "Fork or replay: start from another run's checkpoint (None: a run of its own, the default)"
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> VerlFlowConfig:
        # every problem on its own line (verl_core.config.preflight), all of them at once
        from verl_core.config.preflight import problems

        found = problems(self)
        if found:
            raise ValueError("\n".join(found))
        return self

    @property
    def world_size(self) -> int:
        """Processes of the SFT and RL-loop jobs: ``trainer.nnodes × trainer.n_gpus_per_node``."""
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def use_critic(self) -> bool:
        """Whether the run trains a critic (explicit flag, else only for GAE)."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    def section_without_placement(self, name: str) -> dict[str, Any]:
        """Section ``name`` as JSON without its :data:`PLACEMENT_FIELDS`."""
        section: Section = getattr(self, name)
        return section.model_dump(mode="json", exclude=PLACEMENT_FIELDS.get(name))

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the resolved config (see :func:`config_hash`)."""
        return config_hash(self)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no whitespace: the input of every hash."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(cfg: VerlFlowConfig) -> str:
    """sha256 of the canonical JSON of the resolved config (:func:`config_dump`)."""
    return hashlib.sha256(canonical_json(config_dump(cfg)).encode()).hexdigest()


def config_dump(cfg: VerlFlowConfig) -> dict[str, Any]:
    """The resolved config as JSON, without ``parent`` when it is unset: a run of its own hashes,
    records and flattens exactly as before the section existed (its run id stays the same)."""
    raw = cfg.model_dump(mode="json")
    if raw.get("parent") is None:
        raw.pop("parent", None)
    return raw
