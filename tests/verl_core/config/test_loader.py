"""Loading the config: YAML, dotted overrides with coercion, one-line errors, hashing, flattening."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_core.config import (
    VerlFlowConfig,
    config_hash,
    flatten_config,
    load_config,
    redact_url,
    to_yaml,
    with_overrides,
)
from verl_core.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def test_yaml_and_overrides_with_coercion(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("actor:\n  lr: 1.0e-4\nrollout:\n  n: 2\n")
    cfg = load_config(path, ["actor.lr=1e-6", "rollout.n=8", "rollout.stop=[a, '##']", "trainer.save_freq=0"])
    assert cfg.actor.lr == 1e-6  # "1e-6" is a YAML string; coerced to float by the schema
    assert cfg.rollout.n == 8
    assert cfg.rollout.stop == ["a", "##"]
    assert cfg.trainer.save_freq == 0


def test_string_fields_keep_override_text_verbatim() -> None:
    cfg = load_config(None, ["trainer.experiment_name=0123", "model.path=null", "trainer.resume_mode=12"])
    assert cfg.trainer.experiment_name == "0123"  # not the integer 123
    assert cfg.model.path is None
    assert cfg.trainer.resume_mode == "12"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.lr=abc"], "actor.lr: got 'abc', expected a number"),
        (["actr.lr=1"], "unknown key 'actr' (did you mean 'actor'?)"),
        (["actor.lrr=1"], "unknown key 'actor.lrr' (did you mean 'actor.lr'?)"),
        (["rollout.name=vlm"], "rollout.name: got 'vlm', expected one of 'hf', 'vllm' or 'auto'"),
        (
            ["algorithm.adv_estimator=ppo"],
            "algorithm.adv_estimator: got 'ppo', expected one of 'gae', 'grpo'",
        ),
        (["rollout.n=0"], "rollout.n: got 0, expected a value > 0"),
        (["data.strict=maybe"], "data.strict: got 'maybe', expected true or false"),
        (["trainer.resume_mode=later"], "trainer.resume_mode: got 'later', expected 'auto', 'disable' or"),
        (["actor=3"], "actor: got 3, expected a mapping (section)"),
        (["model.init=pretrained"], "model.path: required when model.init is 'pretrained'"),
        (["actor.lr"], "override 'actor.lr': expected key.path=value"),
        (["actor.lr.x=1"], "override 'actor.lr.x=1': actor.lr is not a section"),
        # a token pasted where its variable's name belongs is not repeated
        (["reward.remote.token_env=sk-live-1"], "reward.remote.token_env: got '***', expected the name of"),
    ],
)
def test_errors_name_field_value_and_expectation(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs" / "quickstart.yaml", overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    top_list = tmp_path / "list.yaml"
    top_list.write_text("- 1\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(top_list)


def test_hash_is_stable_and_sensitive() -> None:
    a, b = VerlFlowConfig(), load_config(None, [])
    assert a.config_hash() == b.config_hash() == config_hash(a)
    assert len(a.config_hash()) == 64
    assert with_overrides(a, ["actor.lr=2e-6"]).config_hash() != a.config_hash()


def test_yaml_roundtrip(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / "quickstart.yaml", ["rollout.n=3"])
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_flatten_redacts_secrets() -> None:
    cfg = load_config(None, ["tracking.uri=http://alice:s3cret@mlflow.internal:5000"])
    flat = flatten_config(cfg)
    assert flat["tracking.uri"] == "http://***@mlflow.internal:5000"
    assert flat["actor.lr"] == "1e-06"
    assert "s3cret" not in " ".join(flat.values())
    # a *_env key holds the name of the variable with the secret: kept
    flat = flatten_config(load_config(None, ["reward.judge.token_env=JUDGE_TOKEN"]))
    assert flat["reward.judge.token_env"] == "JUDGE_TOKEN"
    assert redact_url("s3://bucket/x") == "s3://bucket/x"
