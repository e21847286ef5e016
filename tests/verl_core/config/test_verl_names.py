"""verl's key paths in overrides and YAML: translated through the alias table, dropped keys refused
with why, suggestions that never cross a known confusion, and trainer.total_epochs never silent."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from verl_core.config import load_config, with_overrides
from verl_core.config.loader import is_our_key, load_config_notes
from verl_core.config.verl_names import BUILT_IN, CONVERTED, DROPPED, RENAMED
from verl_core.config.verl_translate import confused, suggest
from verl_core.errors import ConfigError


def test_the_issue_s_verl_overrides_are_applied_to_our_keys() -> None:
    cfg, notes = load_config_notes(
        None,
        [
            "actor_rollout_ref.actor.optim.lr=3e-5",
            "actor_rollout_ref.rollout.n=5",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "critic.optim.lr=2e-5",
            "actor_rollout_ref.model.use_remove_padding=True",
            "trainer.logger=['console','mlflow']",
            "trainer.total_training_steps=7",
            "data.filter_overlong_prompts=True",
        ],
    )
    assert (cfg.actor.lr, cfg.rollout.n, cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef) == (
        3e-5,
        5,
        True,
        0.01,
    )
    assert cfg.rollout.gpu_memory_utilization == 0.3 and cfg.actor.ppo_mini_batch_size == 2
    assert cfg.critic.lr == 2e-5 and cfg.trainer.total_iterations == 7
    assert cfg.tracking.enabled and cfg.tracking.backends == ["mlflow"]
    assert cfg.data.truncation == "drop"
    assert "verl key actor_rollout_ref.actor.optim.lr → actor.lr=3e-5" in notes
    assert "verl key trainer.total_training_steps → trainer.total_iterations=7" in notes
    assert len(notes) == 11  # one line per verl key


def test_verl_yaml_sections_are_translated_too(tmp_path: Path) -> None:
    path = tmp_path / "verl.yaml"
    path.write_text(
        "actor_rollout_ref:\n  actor:\n    optim: {lr: 2.0e-5}\n  rollout: {n: 3}\n"
        "critic:\n  model: {path: null}\n  optim: {lr: 1.0e-4}\n"
        "custom_reward_function: {path: /r/score.py, name: my_fn}\n"
    )
    cfg, notes = load_config_notes(path)
    assert (cfg.actor.lr, cfg.rollout.n, cfg.critic.lr) == (2e-5, 3, 1e-4)
    assert cfg.reward.function == "/r/score.py:my_fn" and [s.name for s in cfg.reward.scorers] == ["function"]
    assert any(n.startswith("verl key critic.optim.lr → critic.lr=") for n in notes)


def test_value_conversions_say_what_differs() -> None:
    cfg = load_config(None, ["trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.logger=console"])
    assert cfg.trainer.save_freq == 0 and cfg.trainer.test_freq == 0  # verl's -1 (never)
    assert not cfg.tracking.enabled  # console only
    # a micro-batch count alone: verl's fixed micro-batches, so token budgets go off here
    cfg = load_config(None, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 3 and not cfg.actor.use_dynamic_bsz
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        ],
    )
    assert cfg.actor.use_dynamic_bsz  # given explicitly: kept, whatever the order
    # filter_overlong_prompts wins over a truncation given after it (verl filters before truncating)
    assert (
        load_config(None, ["data.filter_overlong_prompts=True", "data.truncation=error"]).data.truncation
        == "drop"
    )
    # verl validates greedily unless do_sample, whatever val_kwargs.temperature says
    sampled = [
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
    ]
    assert load_config(None, sampled[:1]).rollout.val_temperature == 0.0
    assert load_config(None, sampled).rollout.val_temperature == 0.6
    # DAPO's overlong buffer: its length and factor count only when enabled
    buffer = ["reward_model.overlong_buffer.len=16", "reward_model.overlong_buffer.penalty_factor=0.5"]
    assert load_config(None, buffer).reward.overlong_buffer_len == 0
    cfg = load_config(None, [*buffer, "reward_model.overlong_buffer.enable=True"])
    assert (cfg.reward.overlong_buffer_len, cfg.reward.overlong_penalty_factor) == (16, 0.5)
    # the same overrides through with_overrides (what flows and rescore use)
    assert with_overrides(load_config(None), ["actor_rollout_ref.rollout.n=6"]).rollout.n == 6


@pytest.mark.parametrize(
    ("override", "says", "never"),
    [
        # the issue's misleading suggestions: a micro-batch count is neither a mini-batch nor a token budget
        ("critic.ppo_micro_batch_size_per_gpu=4", "critic.ppo_max_token_len_per_gpu", "ppo_mini_batch_size"),
        (
            "rollout.log_prob_micro_batch_size_per_gpu=4",
            "verl-flow cuts log-prob micro-batches by token budget, not by count",
            "did you mean",
        ),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "ref.log_prob_max_token_len_per_gpu",
            "did",
        ),
        (
            "actor_rollout_ref.rollout.load_format=safetensors",
            "dropped: a vLLM engine setting",
            "did you mean",
        ),
        ("actor_rollout_ref.model.use_remove_padding=False", "always packed without padding", "did you mean"),
        # near a verl key of the table, not a key of ours with another meaning
        ("critic.ppo_micro_batch_sizes=4", "did you mean verl's 'critic.ppo_micro_batch_size'", "ppo_mini"),
        (
            "actor_rollout_ref.actor.optim.lrr=1",
            "verl's 'actor_rollout_ref.actor.optim.lr'? here it is actor.lr",
            "@",
        ),
        ("trainer.total_epoch=3", "did you mean 'trainer.total_epochs'", "total_iterations"),
        ("actor_rollout_ref.actor.no_such_key=1", "not in verl-flow's table of verl names", "did you mean"),
    ],
)
def test_dropped_and_unknown_keys_fail_naming_why(override: str, says: str, never: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert says in str(info.value)
    assert never not in str(info.value)


def test_suggestions_never_cross_a_known_confusion() -> None:
    # difflib alone ranks these first (ratios ≥ 0.8); each names another quantity
    assert confused("critic.ppo_micro_batch_size_per_gpu", "critic.ppo_mini_batch_size")
    assert confused("rollout.log_prob_micro_batch_size_per_gpu", "rollout.log_prob_max_token_len_per_gpu")
    assert confused("trainer.total_epochs", "trainer.total_iterations")
    assert not confused("actor.lrr", "actor.lr")
    critic = ["critic.ppo_mini_batch_size", "critic.ppo_max_token_len_per_gpu", "critic.ppo_epochs"]
    assert suggest("critic.ppo_micro_batch_size_per_gpu", critic) is None
    rollout = ["rollout.log_prob_max_token_len_per_gpu", "rollout.max_batch_size"]
    assert suggest("rollout.log_prob_micro_batch_size_per_gpu", rollout) is None
    assert suggest("critic.ppo_mini_batch_sise", critic) == "critic.ppo_mini_batch_size"  # a typo is helped


def test_the_table_points_at_keys_that_exist() -> None:
    targets = set(RENAMED.values())
    assert all(is_our_key(t) for t in targets), sorted(t for t in targets if not is_our_key(t))
    # a verl key has one kind of entry, and no verl key of the table is one of ours
    kinds = [set(RENAMED), set(BUILT_IN), set(DROPPED)]
    assert sum(len(k) for k in kinds) == len(set().union(*kinds))
    assert not any(is_our_key(k) for k in (*RENAMED, *BUILT_IN, *DROPPED))
    assert all(k.count(".") >= 1 for k in CONVERTED)


def test_total_epochs_alone_is_refused_and_with_iterations_one_line_says_which_ends(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.total_epochs=15 alone does not set the run's length"):
        load_config(None, ["trainer.total_epochs=15"])
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  total_epochs: 2\n")
    with pytest.raises(ConfigError, match=r"set trainer\.total_iterations too"):
        load_config(path)
    cfg, notes = load_config_notes(path, ["trainer.total_iterations=9"])
    assert (cfg.trainer.total_epochs, cfg.trainer.total_iterations) == (2, 9)
    assert notes == [
        "trainer.total_iterations=9 and trainer.total_epochs=2 are both given: the run stops at whichever "
        "comes first (as verl with total_training_steps)"
    ]
    # verl's total_training_steps is our total_iterations: with total_epochs, the same line
    _, notes = load_config_notes(None, ["trainer.total_epochs=3", "trainer.total_training_steps=4"])
    assert notes[-1].startswith("trainer.total_iterations=4 and trainer.total_epochs=3 are both given")
    with caplog.at_level(logging.INFO, logger="verl_core.config.loader"):
        load_config(path, ["trainer.total_iterations=9"])
    assert "are both given" in caplog.text


def test_config_show_prints_one_line_per_translation() -> None:
    result = CliRunner().invoke(
        app, ["config", "show", "configs/quickstart.yaml", "critic.optim.lr=2e-5", "actor.lr=1e-4"]
    )
    assert result.exit_code == 0, result.output
    lines = [x for x in result.stdout.splitlines() if x.startswith("# verl key")]
    assert lines == ["# verl key critic.optim.lr → critic.lr=2e-5"]  # actor.lr is ours: no line


def test_no_verl_key_is_accepted_silently() -> None:
    # a verl key that sets nothing (built in, or read with another key) is accepted only with a line
    # that says so; with any other value it is refused
    for key, (value, _) in BUILT_IN.items():
        text = value if isinstance(value, str) else str(value).lower()
        _, notes = load_config_notes(None, [f"{key}={text}"])
        assert notes == [f"verl key {key} → nothing to set (built in: {BUILT_IN[key][1]})"], key
    _, notes = load_config_notes(None, ["custom_reward_function.name=my_fn"])
    assert notes == [
        "verl key custom_reward_function.name → nothing to set (read with custom_reward_function.path)"
    ]


def test_reward_manager_sets_how_the_custom_function_is_called() -> None:
    # verl's naive manager calls compute_score once per sample, its batch manager once per batch with
    # lists: our reward.function_mode (before: only naive was accepted, batch refused as "not available")
    cfg, notes = load_config_notes(None, ["reward_model.reward_manager=batch"])
    assert cfg.reward.function_mode == "batch"
    assert notes[0].startswith("verl key reward_model.reward_manager → reward.function_mode=batch")
    cfg = load_config(None, ["reward.function_mode=batch", "reward_model.reward_manager=naive"])
    assert cfg.reward.function_mode == "sample"
    # another manager is refused naming why and what to use instead
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward_model.reward_manager=dapo"])
    assert "'dapo' reward manager has no counterpart" in str(info.value)
    assert "reward.function_mode=batch" in str(info.value)


def test_custom_reward_function_reward_kwargs_become_reward_function_kwargs(tmp_path: Path) -> None:
    # verl passes custom_reward_function.reward_kwargs to every call of the function (as keywords):
    # ours is reward.function_kwargs; Hydra's per-key form and the whole dict both map (before: unknown)
    cfg, notes = load_config_notes(
        None, ["custom_reward_function.reward_kwargs.weight=2.5", "custom_reward_function.reward_kwargs.m=x"]
    )
    assert cfg.reward.function_kwargs == {"weight": 2.5, "m": "x"}
    assert (
        notes[0] == "verl key custom_reward_function.reward_kwargs.weight → reward.function_kwargs.weight=2.5"
    )
    cfg = load_config(None, ["custom_reward_function.reward_kwargs={weight: 2, bonus: 0.5}"])
    assert cfg.reward.function_kwargs == {"weight": 2, "bonus": 0.5}
    path = tmp_path / "verl.yaml"  # verl's section in a YAML file
    path.write_text("custom_reward_function:\n  path: r.py\n  name: f\n  reward_kwargs:\n    weight: 4\n")
    cfg = load_config(path)
    assert (cfg.reward.function, cfg.reward.function_kwargs) == ("r.py:f", {"weight": 4})
