"""A key set to a value that does nothing under another key's value is said in one advice line
(verl_core.config.inert), never ignored silently: each pair of the table, inert and active."""

from __future__ import annotations

import pytest

from verl_core.config import load_config
from verl_core.config.inert import inert_settings
from verl_core.errors import ConfigError

# (overrides that leave KEY inert, KEY, the overrides that give it its effect)
PAIRS = [
    # the micro-batch count and the token budget: one of the two cuts the update's micro-batches
    (
        ["actor.ppo_micro_batch_size_per_gpu=4"],
        "actor.ppo_micro_batch_size_per_gpu",
        ["actor.use_dynamic_bsz=false"],
    ),
    (
        ["actor.use_dynamic_bsz=false", "actor.ppo_max_token_len_per_gpu=2048"],
        "actor.ppo_max_token_len_per_gpu",
        ["actor.use_dynamic_bsz=true"],
    ),
    (["actor.kl_loss_coef=0.01"], "actor.kl_loss_coef", ["actor.use_kl_loss=true"]),
    (["actor.kl_loss_type=kl"], "actor.kl_loss_type", ["actor.use_kl_loss=true"]),
    (
        ["actor.zero_stage=3"],
        "actor.zero_stage",
        ["actor.strategy=deepspeed", "rollout.share_weights=false"],  # hf samples its own copy
    ),
    (["critic.lr=2e-5"], "critic.lr", ["algorithm.adv_estimator=gae"]),  # GRPO (default): no critic
    (["critic.lr=2e-5"], "critic.lr", ["critic.enable=true"]),
    (
        ["critic.mixed_precision.param_dtype=bfloat16"],
        "critic.mixed_precision.param_dtype",
        ["critic.enable=true"],
    ),
    (
        ["algorithm.adv_estimator=gae", "critic.zero_stage=3"],
        "critic.zero_stage",
        ["critic.strategy=deepspeed"],
    ),
    (["algorithm.kl_penalty=low_var_kl"], "algorithm.kl_penalty", ["algorithm.use_kl_in_reward=true"]),
    (["algorithm.kl_ctrl.kl_coef=0.01"], "algorithm.kl_ctrl.kl_coef", ["algorithm.use_kl_in_reward=true"]),
    (
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.target_kl=0.2"],
        "algorithm.kl_ctrl.target_kl",
        ["algorithm.kl_ctrl.type=adaptive"],
    ),
    (
        ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.horizon=500"],
        "algorithm.kl_ctrl.horizon",
        ["algorithm.kl_ctrl.type=adaptive"],
    ),
    (["algorithm.lam=0.95"], "algorithm.lam", ["algorithm.adv_estimator=gae"]),
    (
        ["algorithm.adv_estimator=rloo", "algorithm.norm_adv_by_std_in_grpo=false"],
        "algorithm.norm_adv_by_std_in_grpo",
        ["algorithm.adv_estimator=grpo"],
    ),
    (
        ["algorithm.filter_groups.metric=score"],
        "algorithm.filter_groups.metric",
        ["algorithm.filter_groups.enable=true"],
    ),
    (
        ["algorithm.rollout_correction.rollout_is_threshold=3"],
        "algorithm.rollout_correction.rollout_is_threshold",
        ["algorithm.rollout_correction.rollout_is=token"],
    ),
    (
        ["algorithm.rollout_correction.rollout_rs_threshold=3"],
        "algorithm.rollout_correction.rollout_rs_threshold",
        ["algorithm.rollout_correction.rollout_rs=token"],
    ),
    (
        ["algorithm.rollout_correction.rollout_rs_threshold_lower=0.5"],
        "algorithm.rollout_correction.rollout_rs_threshold_lower",
        ["algorithm.rollout_correction.rollout_rs=token"],
    ),
    (["sft.enable=false", "sft.lr=1e-3"], "sft.lr", ["sft.enable=true"]),
    (["rollout.multi_turn.max_turns=2"], "rollout.multi_turn.max_turns", ["rollout.multi_turn.enable=true"]),
    (["model.lora_alpha=32"], "model.lora_alpha", ["model.lora_rank=8"]),
    (["model.lora_dropout=0.1"], "model.lora_dropout", ["model.lora_rank=8"]),
    (["model.target_modules=[q_proj]"], "model.target_modules", ["model.lora_rank=8"]),
    (
        ["reward.overlong_penalty_factor=0.5"],
        "reward.overlong_penalty_factor",
        ["reward.overlong_buffer_len=16"],
    ),
    (["reward.function=my_reward.py:f"], "reward.function", ["reward.scorers=[function]"]),
    (
        ["reward.function_mode=batch"],
        "reward.function_mode",
        ["reward.scorers=[function]", "reward.function=my_reward.py:f"],
    ),
    (
        ["reward.function_kwargs={weight: 2}"],
        "reward.function_kwargs.weight",  # a dict's line names the key set in it
        ["reward.scorers=[function]", "reward.function=my_reward.py:f"],
    ),
]


@pytest.mark.parametrize(("inert", "key", "active"), PAIRS, ids=[f"{p[1]}|{p[2][0]}" for p in PAIRS])
def test_an_inert_setting_gets_one_line_and_an_active_one_none(
    inert: list[str], key: str, active: list[str]
) -> None:
    lines = inert_settings(load_config(None, inert))
    assert [line.split(":")[0] for line in lines] == [key], lines
    assert " has no effect while " in lines[0]
    assert inert_settings(load_config(None, [*inert, *active])) == []


def test_defaults_and_a_default_value_given_explicitly_get_no_line() -> None:
    assert inert_settings(load_config(None)) == []
    # the default value written out changes nothing: no line (8 is the schema's micro-batch count)
    assert inert_settings(load_config(None, ["actor.ppo_micro_batch_size_per_gpu=8"])) == []


def test_the_line_reaches_the_loaders_warnings(caplog: pytest.LogCaptureFixture) -> None:
    # verl's own form: a micro-batch count beside use_dynamic_bsz=True, which ignores it (verl too)
    verl = [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor.lr=6e-5",  # a from-scratch model's rate: no other warning
    ]
    cfg = load_config(None, verl)
    assert (cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.use_dynamic_bsz) == (4, True)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "actor.ppo_micro_batch_size_per_gpu: 4 has no effect while actor.use_dynamic_bsz=true (the default): "
        "the update's micro-batches are cut by actor.ppo_max_token_len_per_gpu tokens (verl too ignores the "
        "count then); actor.use_dynamic_bsz=false counts samples"
    ]
    caplog.clear()
    load_config(None, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor.lr=6e-5"])
    # alone, verl's count turns the token budget off (verl's default use_dynamic_bsz=False): no line
    assert [r for r in caplog.records if r.levelname == "WARNING"] == []


def test_an_inert_token_budget_is_not_refused() -> None:
    # with counted micro-batches the actor's token budget cuts nothing: a budget smaller than one sample
    # (128 + 64 tokens by default) is inert, said in a line, not a reason to refuse the run
    with pytest.raises(ConfigError, match=r"^actor.ppo_max_token_len_per_gpu: 100 tokens cannot hold"):
        load_config(None, ["actor.ppo_max_token_len_per_gpu=100"])
    cfg = load_config(None, ["actor.use_dynamic_bsz=false", "actor.ppo_max_token_len_per_gpu=100"])
    assert [line.split(":")[0] for line in inert_settings(cfg)] == ["actor.ppo_max_token_len_per_gpu"]


@pytest.mark.parametrize(
    ("verl_key", "budget"),
    [
        ("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_max_token_len_per_gpu"),
        ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "ref.log_prob_max_token_len_per_gpu"),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
            "rollout.log_prob_max_token_len_per_gpu",
        ),
    ],
)
def test_counts_with_no_key_here_are_refused_naming_the_budget(verl_key: str, budget: str) -> None:
    # the critic's, the reference's and the log-prob forwards' micro-batches are token budgets only:
    # verl's counts for them would do nothing, so they are refused (not accepted and ignored)
    with pytest.raises(ConfigError, match=rf"^{verl_key} dropped: .*{budget}"):
        load_config(None, [f"{verl_key}=8"])
