"""Settings that do nothing under another setting's value: one advice line per such key given a value
other than its default, so that no accepted key is silently ignored.

verl ignores these the same way (its actor's ``ppo_micro_batch_size_per_gpu`` under
``use_dynamic_bsz=True``, its KL coefficients with the KL off, a critic's settings in a run without
one) and says nothing; verl-flow runs the config as given and says it in one line
(:func:`verl_core.config.preflight.advice`, logged as a warning), since a verl script sets many of
them on purpose (both micro-batch forms, then switches between them).

:data:`INERT` is the table: a key (or a section, every key under it but the ones that switch it on)
and the condition under which it is inert, as the text that follows "has no effect while".
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from verl_core.config.schema import VerlFlowConfig


class Inert(NamedTuple):
    """``key`` (a field, or a section: every field under it but ``keep``) does nothing while
    ``when(cfg)`` returns a reason (None: it has its effect)."""

    key: str
    when: Callable[[VerlFlowConfig], str | None]
    keep: tuple[str, ...] = ()


def _if(test: Callable[[VerlFlowConfig], bool], why: str) -> Callable[[VerlFlowConfig], str | None]:
    return lambda cfg: why if test(cfg) else None


def _no_critic(cfg: VerlFlowConfig) -> str | None:
    if cfg.use_critic:
        return None
    given = "critic.enable=false" if cfg.critic.enable is False else "critic.enable unset"
    return f"no critic is trained ({given}, algorithm.adv_estimator={cfg.algorithm.adv_estimator})"


_DYNAMIC = (
    "actor.use_dynamic_bsz=true (the default): the update's micro-batches are cut by "
    "actor.ppo_max_token_len_per_gpu tokens (verl too ignores the count then); "
    "actor.use_dynamic_bsz=false counts samples"
)
_FIXED = (
    "actor.use_dynamic_bsz=false: the actor's and the critic's update micro-batches hold "
    "actor.ppo_micro_batch_size_per_gpu samples each"
)
_KL_IN_REWARD = "algorithm.use_kl_in_reward=false (no KL penalty in the reward)"

INERT: tuple[Inert, ...] = (
    Inert("actor.ppo_micro_batch_size_per_gpu", _if(lambda c: c.actor.use_dynamic_bsz, _DYNAMIC)),
    Inert("actor.ppo_max_token_len_per_gpu", _if(lambda c: not c.actor.use_dynamic_bsz, _FIXED)),
    Inert("actor.kl_loss_coef", _if(lambda c: not c.actor.use_kl_loss, "actor.use_kl_loss=false")),
    Inert("actor.kl_loss_type", _if(lambda c: not c.actor.use_kl_loss, "actor.use_kl_loss=false")),
    Inert(
        "actor.zero_stage",
        _if(lambda c: c.actor.strategy != "deepspeed", "actor.strategy is not deepspeed"),
    ),
    Inert("critic", _no_critic, keep=("critic.enable",)),
    Inert(
        "critic.zero_stage",
        _if(lambda c: c.critic.strategy != "deepspeed", "critic.strategy is not deepspeed"),
    ),
    Inert("algorithm.kl_penalty", _if(lambda c: not c.algorithm.use_kl_in_reward, _KL_IN_REWARD)),
    Inert("algorithm.kl_ctrl", _if(lambda c: not c.algorithm.use_kl_in_reward, _KL_IN_REWARD)),
    Inert(
        "algorithm.kl_ctrl.target_kl",
        _if(lambda c: c.algorithm.kl_ctrl.type == "fixed", "algorithm.kl_ctrl.type=fixed (β stays kl_coef)"),
    ),
    Inert(
        "algorithm.kl_ctrl.horizon",
        _if(lambda c: c.algorithm.kl_ctrl.type == "fixed", "algorithm.kl_ctrl.type=fixed (β stays kl_coef)"),
    ),
    Inert(
        "algorithm.lam",
        _if(lambda c: c.algorithm.adv_estimator != "gae", "algorithm.adv_estimator is not gae (λ is GAE's)"),
    ),
    Inert(
        "algorithm.norm_adv_by_std_in_grpo",
        _if(lambda c: c.algorithm.adv_estimator != "grpo", "algorithm.adv_estimator is not grpo"),
    ),
    Inert(
        "algorithm.filter_groups",
        _if(lambda c: not c.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=false"),
        keep=("algorithm.filter_groups.enable",),
    ),
    Inert(
        "algorithm.rollout_correction.rollout_is_threshold",
        _if(
            lambda c: c.algorithm.rollout_correction.rollout_is is None, "rollout_correction.rollout_is unset"
        ),
    ),
    Inert(
        "algorithm.rollout_correction.rollout_rs_threshold",
        _if(
            lambda c: c.algorithm.rollout_correction.rollout_rs is None, "rollout_correction.rollout_rs unset"
        ),
    ),
    Inert(
        "algorithm.rollout_correction.rollout_rs_threshold_lower",
        _if(
            lambda c: c.algorithm.rollout_correction.rollout_rs is None, "rollout_correction.rollout_rs unset"
        ),
    ),
    Inert("sft", _if(lambda c: not c.sft.enable, "sft.enable=false (no SFT stage)"), keep=("sft.enable",)),
    Inert(
        "rollout.multi_turn",
        _if(lambda c: not c.rollout.multi_turn.enable, "rollout.multi_turn.enable=false"),
        keep=("rollout.multi_turn.enable",),
    ),
    *(
        Inert(f"model.{k}", _if(lambda c: c.model.lora_rank == 0, "model.lora_rank=0 (full fine-tuning)"))
        for k in ("lora_alpha", "lora_dropout", "target_modules")
    ),
    Inert(
        "reward.overlong_penalty_factor",
        _if(
            lambda c: c.reward.overlong_buffer_len == 0, "reward.overlong_buffer_len=0 (no overlong penalty)"
        ),
    ),
    *(
        Inert(
            f"reward.{k}",
            _if(
                lambda c: all(s.name != "function" for s in c.reward.scorers),
                "reward.scorers has no 'function' scorer",
            ),
        )
        for k in ("function", "function_mode", "function_kwargs")
    ),
)


def inert_settings(cfg: VerlFlowConfig) -> list[str]:
    """One line per key of :data:`INERT` whose value differs from the schema default while its
    condition holds (the reason of the first entry naming the key whose condition holds)."""
    given = _flat(cfg.model_dump(mode="json"))
    default = _defaults(type(cfg))
    out: list[str] = []
    for key, value in given.items():
        if value == default.get(key):
            continue
        why = next((w for e in INERT if _names(e, key) and (w := e.when(cfg)) is not None), None)
        if why is not None:
            out.append(f"{key}: {json.dumps(value)} has no effect while {why}")
    return out


def _names(entry: Inert, key: str) -> bool:
    return (key == entry.key or key.startswith(entry.key + ".")) and key not in entry.keep


@functools.cache
def _defaults(schema: type[VerlFlowConfig]) -> dict[str, Any]:
    """The schema's defaults, flat; the class comes from the config given (no import of the schema,
    which imports the checks that import this module)."""
    return _flat(schema.model_validate({}).model_dump(mode="json"))


def _flat(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
