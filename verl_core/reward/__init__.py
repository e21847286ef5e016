"""Reward scoring: data_source rules, custom functions, a reward model, HTTP scorers (a remote
endpoint, an LLM judge), weighted, with DAPO's overlong penalty. Pure functions over plain values;
the reward stage (``stages/reward.py``) and the RL loop both call :func:`score_rollouts`.

Example::

    from verl_core.reward import RuleOptions, RuleScorer, WeightedScorer, batch_from_columns, score_rollouts

    rule = RuleScorer(RuleOptions("strict", score=1.0, format_score=0.0), num_workers=2,
                      parallel_min_samples=10000)
    result = score_rollouts(batch_from_columns(rollouts_table), [WeightedScorer("rule", 1.0, rule)],
                            on_error="fail", max_response_length=512)
    result.scores, result.metrics["reward/accuracy"]

The reward model part (``verl_core.reward.model``) imports torch/transformers only when called.
"""

from verl_core.reward.call_forms import CallForm, call_form
from verl_core.reward.functions import (
    FUNCTION_MODES,
    ErrorKind,
    FunctionInputs,
    FunctionMode,
    FunctionScores,
    is_deterministic,
    load_reward_function,
    run_reward_function,
)
from verl_core.reward.http import HttpOptions, RemoteConfigError
from verl_core.reward.model import ModelScorer, load_reward_scorer, reward_model_scores
from verl_core.reward.remote import JudgeScorer, RemoteScorer
from verl_core.reward.rules import (
    RULE_SCORERS,
    RuleOptions,
    RuleScore,
    RuleScoreFn,
    arithmetic_score,
    boxed_math_score,
    extract_gsm8k,
    get_rule_scorer,
    gsm8k_score,
    last_boxed,
    normalize_math,
    register_rule,
)
from verl_core.reward.scorers import (
    CodeScorer,
    FunctionScorer,
    RewardBatch,
    RuleScorer,
    Scorer,
    ScorerOutput,
    score_rules,
)
from verl_core.reward.scoring import (
    OVERLONG,
    OnError,
    RewardError,
    RewardResult,
    ScorerCodeError,
    WeightedScorer,
    batch_from_columns,
    metrics_of_rows,
    overlong_penalty,
    reward_metrics,
    rewards_table,
    score_rollouts,
)

__all__ = [
    "FUNCTION_MODES",
    "OVERLONG",
    "RULE_SCORERS",
    "CallForm",
    "CodeScorer",
    "ErrorKind",
    "FunctionInputs",
    "FunctionMode",
    "FunctionScorer",
    "FunctionScores",
    "HttpOptions",
    "JudgeScorer",
    "ModelScorer",
    "OnError",
    "RemoteConfigError",
    "RemoteScorer",
    "RewardBatch",
    "RewardError",
    "RewardResult",
    "RuleOptions",
    "RuleScore",
    "RuleScoreFn",
    "RuleScorer",
    "Scorer",
    "ScorerCodeError",
    "ScorerOutput",
    "WeightedScorer",
    "arithmetic_score",
    "batch_from_columns",
    "boxed_math_score",
    "call_form",
    "extract_gsm8k",
    "get_rule_scorer",
    "gsm8k_score",
    "is_deterministic",
    "last_boxed",
    "load_reward_function",
    "load_reward_scorer",
    "metrics_of_rows",
    "normalize_math",
    "overlong_penalty",
    "register_rule",
    "reward_metrics",
    "reward_model_scores",
    "rewards_table",
    "run_reward_function",
    "score_rollouts",
    "score_rules",
]
