"""The one typed configuration of a verl-flow run.

:mod:`.schema` assembles the sections (:mod:`.model`, :mod:`.training`, :mod:`.generation`,
:mod:`.run`, :mod:`.gate`, on :mod:`.base`) with every default and one-line description, runs the
cross-field checks of :mod:`.preflight` (which also words the advice lines, with :mod:`.inert`'s
settings that do nothing under another one) and hashes a config (:func:`.schema.config_hash`);
:mod:`.loader` reads YAML, applies dotted overrides (``actor.lr=1e-6``), words errors as one line
(field path, value given, what was expected) and flattens; :mod:`.verl_names` and
:mod:`.verl_translate` read verl's key names. Import from here::

    from verl_core.config import VerlFlowConfig, load_config, with_overrides
"""

from verl_core.algorithms import LossAggMode
from verl_core.config.base import (
    AdvEstimator,
    KLEstimator,
    NonNegFloat,
    NonNegInt,
    PolicyLoss,
    PositiveFloat,
    PositiveInt,
    Prob,
    Section,
)
from verl_core.config.gate import GateConfig
from verl_core.config.generation import (
    HttpEndpointConfig,
    JudgeConfig,
    MultiTurnConfig,
    RemoteRewardConfig,
    RewardConfig,
    RewardScorerConfig,
    RolloutConfig,
)
from verl_core.config.loader import (
    apply_override,
    flatten_config,
    load_config,
    redact_url,
    to_yaml,
    validate_config,
    with_overrides,
)
from verl_core.config.model import DataConfig, MixedPrecisionConfig, ModelConfig, QuantizationConfig
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
from verl_core.config.schema import (
    PLACEMENT_FIELDS,
    VerlFlowConfig,
    canonical_json,
    config_dump,
    config_hash,
)
from verl_core.config.training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    FilterGroupsConfig,
    KLControlConfig,
    RefConfig,
    RolloutCorrectionConfig,
    SFTConfig,
)

__all__ = [
    "PLACEMENT_FIELDS",
    "ActorConfig",
    "AdvEstimator",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "ExecutionConfig",
    "ExportConfig",
    "FilterGroupsConfig",
    "GateConfig",
    "HttpEndpointConfig",
    "JudgeConfig",
    "KLControlConfig",
    "KLEstimator",
    "LossAggMode",
    "MixedPrecisionConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "NonNegFloat",
    "NonNegInt",
    "ParentConfig",
    "PolicyLoss",
    "PositiveFloat",
    "PositiveInt",
    "Prob",
    "QuantizationConfig",
    "RefConfig",
    "RemoteRewardConfig",
    "RetrainConfig",
    "RewardConfig",
    "RewardScorerConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SFTConfig",
    "SandboxConfig",
    "Section",
    "StoreConfig",
    "TrackingConfig",
    "TrainerConfig",
    "VerlFlowConfig",
    "apply_override",
    "canonical_json",
    "config_dump",
    "config_hash",
    "flatten_config",
    "load_config",
    "redact_url",
    "to_yaml",
    "validate_config",
    "with_overrides",
]
