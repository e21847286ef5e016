"""Validation stage on a tiny model: greedy held-out accuracy = mean ``correct`` of the committed
rewards, committed with the policy lineage, skipped on rerun, refused for the wrong policy version;
with partial-credit rewards, accuracy is the fraction scoring ≥ ``reward.correct_threshold`` (not the
mean reward), as the eval stage counts it on the same policy; the scorers are built once for the
RL session's validations."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from stages.eval import evaluate
from stages.floor import scorers
from stages.floor import session as session_module
from stages.floor.artifacts import in_run_source
from stages.floor.checkpoint import save_checkpoint
from stages.floor.locations import iteration_stage, validations
from stages.floor.reports import read_eval_report
from stages.floor.session import RLSession
from stages.validate import validate
from tests.stages.conftest import TINY_RL, opened
from verl_core.config import RewardConfig, SandboxConfig, VerlFlowConfig, validate_config
from verl_core.reward import WeightedScorer
from verl_core.runtime.run import RunContext

# scores 0.5 or 1.0 (tests/flows/rl_rewards.py); the default correct_threshold is 1.0
PARTIAL_CREDIT = validate_config(
    {
        **TINY_RL.model_dump(mode="json"),
        "reward": {"scorers": [{"name": "function"}], "function": "tests.flows.rl_rewards:half_credit"},
        "eval": {"k": 1},  # greedy only, as validation
    }
)

PASS_AT_K = PARTIAL_CREDIT.model_copy(update={"eval": PARTIAL_CREDIT.eval.model_copy(update={"k": 4})})


def _validate(ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, iteration: int) -> float:
    """The validate task's function with the sections the RL loop hands it."""
    return validate.fn(
        ctx, cfg.data, cfg.rollout, cfg.reward, cfg.eval, cfg.sandbox, template_pack_uri, iteration,
        cfg.tracking.log_samples,
    )  # fmt: skip


@pytest.fixture
def session(tiny_rl: tuple[Path, str]) -> Iterator[RLSession]:
    run = RunContext(run_id="validate", store_url=str(tiny_rl[0]))
    with opened(run, TINY_RL, tiny_rl[1], None) as opened_session:
        yield opened_session


@pytest.fixture
def ctx(session: RLSession, tiny_rl: tuple[Path, str]) -> RunContext:
    return RunContext(run_id=session.run_id, store_url=str(tiny_rl[0]))


def test_validation_accuracy_is_the_mean_of_correct(
    ctx: RunContext, session: RLSession, tiny_rl: tuple[Path, str]
) -> None:
    store = ctx.store()
    accuracy = _validate(ctx, TINY_RL, tiny_rl[1], 0)
    m = store.committed(ctx.run_id, iteration_stage(0, "val"))
    assert m is not None
    rollouts, rewards = store.read_table(m, "rollouts.parquet"), store.read_table(m, "rewards.parquet")
    # rollout.val_n = 1 greedy sample per held-out prompt (8 of them)
    assert rollouts.num_rows == rewards.num_rows == 8
    correct = rewards.column("correct").to_pylist()
    assert accuracy == sum(correct) / len(correct)
    assert m.summary["val/accuracy"] == accuracy and m.summary["iteration_lineage"] == session.lineage
    assert validations(store, ctx.run_id, session.lineage) == {0: accuracy}

    # a rerun reads the committed accuracy and generates nothing
    def no_generation(*args: object, **kwargs: object) -> None:
        raise AssertionError("validation generated again")

    session.engine.generate = no_generation  # type: ignore[method-assign]
    assert _validate(ctx, TINY_RL, tiny_rl[1], 0) == accuracy


def test_validation_needs_the_policy_of_its_iteration(ctx: RunContext, tiny_rl: tuple[Path, str]) -> None:
    with pytest.raises(RuntimeError, match="validation at iteration 1 needs policy version 1, have 0"):
        _validate(ctx, TINY_RL, tiny_rl[1], 1)


def test_partial_credit_accuracy_counts_scores_at_the_threshold(tiny_rl: tuple[Path, str]) -> None:
    cfg: VerlFlowConfig = PARTIAL_CREDIT
    assert cfg.reward.correct_threshold == 1.0
    ctx = RunContext(run_id="validate-partial", store_url=str(tiny_rl[0]))
    store = ctx.store()
    with opened(ctx, cfg, tiny_rl[1], None) as session:
        accuracy = _validate(ctx, cfg, tiny_rl[1], 0)
        save_checkpoint(session, ctx, cfg, 0)  # the same policy, for the eval stage
    m = store.committed(ctx.run_id, iteration_stage(0, "val"))
    assert m is not None
    rewards = store.read_table(m, "rewards.parquet")
    scores = rewards.column("score").to_pylist()
    # both kinds of score occur, so "mean score" and "fraction correct" can tell each other apart
    assert set(scores) == {0.5, 1.0}
    full = sum(s >= 1.0 for s in scores)
    assert rewards.column("correct").to_pylist() == [s >= 1.0 for s in scores]
    # as of writing 5 of 8 score 1.0 and 3 score 0.5: accuracy 5/8 = 0.625, reward mean
    # (5·1.0 + 3·0.5)/8 = 0.8125 (mean correct ≠ mean score whenever some sample scores 0.5)
    assert accuracy == m.summary["val/accuracy"] == full / len(scores)
    assert m.summary["val/reward_mean"] == sum(scores) / len(scores)
    assert m.summary["val/reward_mean"] > accuracy
    # eval.k = 1: no sampled pass, no pass@k
    assert "val/pass_at_1" not in m.summary and all(not f.name.startswith("sampled/") for f in m.files)

    # the eval stage on the same policy: the same greedy samples, the same verdicts, the same accuracy
    uri = evaluate.fn(ctx, cfg, tiny_rl[1], in_run_source(store, ctx.run_id, 0))
    ev = store.read_manifest(uri)
    assert (
        store.read_table(ev, "greedy/rollouts.parquet").column("response_text").to_pylist()
        == store.read_table(m, "rollouts.parquet").column("response_text").to_pylist()
    )
    assert store.read_table(ev, "greedy/rewards.parquet").column("correct").to_pylist() == (
        rewards.column("correct").to_pylist()
    )
    assert read_eval_report(store, uri).accuracy == accuracy


def test_validation_pass_at_k_is_the_eval_stages(tiny_rl: tuple[Path, str]) -> None:
    # besides the greedy pass, eval.k = 4 samples per held-out prompt at eval.temperature, scored with
    # half credit (correct about half the time, so pass@1 and pass@4 are neither 0 nor equal)
    cfg = PASS_AT_K
    k = cfg.eval.k
    ctx = RunContext(run_id="validate-pass-at-k", store_url=str(tiny_rl[0]))
    store = ctx.store()
    with opened(ctx, cfg, tiny_rl[1], None) as session:
        _validate(ctx, cfg, tiny_rl[1], 0)
        save_checkpoint(session, ctx, cfg, 0)  # the same policy, for the eval stage
    m = store.committed(ctx.run_id, iteration_stage(0, "val"))
    assert m is not None
    rewards = store.read_table(m, "sampled/rewards.parquet")
    assert rewards.num_rows == 8 * k  # 8 held-out prompts × 4 samples
    correct = rewards.column("correct").to_pylist()
    groups = rewards.column("group_id").to_pylist()
    # with n = k samples per prompt the unbiased estimator reduces to counting:
    # pass@1 = the mean of correct over all 32 samples; pass@4 = the share of prompts with a correct sample
    assert m.summary["val/pass_at_1"] == pytest.approx(sum(correct) / len(correct))
    solved = {g for g, ok in zip(groups, correct, strict=True) if ok}
    assert m.summary["val/pass_at_4"] == pytest.approx(len(solved) / 8)
    # as of writing 15 of the 32 samples are correct (pass@1 15/32 = 0.46875) and 7 of the 8 prompts
    # have a correct sample (pass@4 7/8 = 0.875)
    assert 0 < m.summary["val/pass_at_1"] < m.summary["val/pass_at_4"] < 1

    # one definition: the eval stage on the same policy draws the same samples and reports the same pass@k
    uri = evaluate.fn(ctx, cfg, tiny_rl[1], in_run_source(store, ctx.run_id, 0))
    ev = store.read_manifest(uri)
    assert store.read_table(ev, "sampled/rewards.parquet").column("correct").to_pylist() == correct
    report = read_eval_report(store, uri)
    assert (report.pass_at_1, report.pass_at_k) == (m.summary["val/pass_at_1"], m.summary["val/pass_at_4"])


def test_validations_of_one_run_build_the_scorers_once(
    tiny_rl: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[RewardConfig] = []
    build = scorers.build_scorers

    def counting(cfg: RewardConfig, sandbox: SandboxConfig) -> list[WeightedScorer]:
        builds.append(cfg)
        return build(cfg, sandbox)

    monkeypatch.setattr(session_module, "build_scorers", counting)
    cfg = PASS_AT_K  # a greedy and a sampled pass each validation, scored by the same scorers

    def val_samples(n: int) -> VerlFlowConfig:  # other stage params (a new attempt), the same reward
        return cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_val_samples": n})})

    ctx = RunContext(run_id="validate-scorers", store_url=str(tiny_rl[0]))
    with opened(ctx, cfg, tiny_rl[1], None):
        _validate(ctx, val_samples(8), tiny_rl[1], 0)
        _validate(ctx, val_samples(7), tiny_rl[1], 0)
        assert len(builds) == 1
    with opened(ctx, cfg, tiny_rl[1], None):  # the run's next session builds them again
        _validate(ctx, val_samples(6), tiny_rl[1], 0)
    assert len(builds) == 2
