"""The RL loop flow on a tiny model: a run killed after a committed checkpoint resumes to exactly the
weights of an uninterrupted run; GAE trains and checkpoints a critic; a non-finite reward stops the
update before anything of that iteration's update is committed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import flows.rl as rl_flow
import verl_core.training.ppo as ppo_module
from flows.rl import rl_loop
from stages.floor.locations import list_checkpoints
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig
from verl_core.reward.scoring import RewardError
from verl_core.runtime.run import RunContext
from verl_core.training.engine import NonFiniteError

CFG = VerlFlowConfig.model_validate(
    {
        "data": {
            "arithmetic_train_size": 64,
            "arithmetic_val_size": 8,
            "train_batch_size": 2,
            "max_response_length": 16,
            "truncation": "right",  # SFT targets (unused here) may be longer than 16 tokens
        },
        "model": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "actor": {"lr": 1e-3, "ppo_mini_batch_size": 1},
        "critic": {"lr": 1e-3},
        "rollout": {"n": 2},
        # a reward that varies between samples of the random policy, so gradients are not zero
        "reward": {"scorers": [{"name": "function"}], "function": "tests.flows.rl_rewards:text_hash"},
        "trainer": {
            "total_iterations": 3,
            "save_freq": 1,
            "test_freq": 0,
            "val_before_train": False,
            "max_ckpt_to_keep": 5,
            "device": "cpu",
        },
        "execution": {"task_retries": 0},
        "tracking": {"enabled": False},
    }
)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("rl")
    ctx = RunContext(run_id="data", store_url=str(root))
    return root, template_pack.fn(ctx, CFG.data, CFG.model, preprocess.fn(ctx, CFG.data))


def _ctx(root: Path, run_id: str) -> RunContext:
    return RunContext(run_id=run_id, store_url=str(root))


def _files(ctx: RunContext, stage: str) -> dict[str, str]:
    m = ctx.store().committed(ctx.run_id, stage)
    assert m is not None, f"{stage} of {ctx.run_id} is not committed"
    return {f.name: f.sha256 for f in m.files}


def test_killed_rl_loop_resumes_to_identical_weights(
    prompts: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tp = prompts
    straight = _ctx(root, "straight")
    out = rl_loop(straight, CFG, tp, None)
    assert out.checkpoint.endswith("ckpt/iter-0003/manifest.json")
    assert list_checkpoints(straight.store(), "straight") == [1, 2, 3]
    for it in range(3):  # non-zero advantages: the optimizer state matters for the next step
        update = straight.store().committed("straight", f"iter-{it:04d}/update")
        assert update is not None and update.summary["critic/advantages/max"] > 0
    final = _files(straight, "ckpt/iter-0003")
    assert final["policy/model.safetensors"] != _files(straight, "ckpt/iter-0001")["policy/model.safetensors"]

    # killed in the update of iteration 2, after ckpt/iter-0002 and iteration 2's rollout and reward
    crashed = _ctx(root, "crashed")
    real_update = rl_flow.ppo_update

    def dying_update(ctx: RunContext, cfg: VerlFlowConfig, r: str, w: str, it: int) -> Any:
        if it == 2:
            raise KeyboardInterrupt("killed")
        return real_update(ctx, cfg, r, w, it)

    monkeypatch.setattr(rl_flow, "ppo_update", dying_update)
    with pytest.raises(KeyboardInterrupt):
        rl_loop(crashed, CFG, tp, None)
    store = crashed.store()
    assert list_checkpoints(store, "crashed") == [1, 2]
    assert store.committed("crashed", "iter-0002/rollout") is not None
    assert store.committed("crashed", "iter-0002/update") is None
    rollout_attempt = store.committed("crashed", "iter-0002/rollout").attempt  # type: ignore[union-attr]
    monkeypatch.setattr(rl_flow, "ppo_update", real_update)

    out = rl_loop(crashed, CFG, tp, None)
    assert out.checkpoint.endswith("ckpt/iter-0003/manifest.json")
    # the committed rollout of iteration 2 was reused, not sampled again
    assert store.committed("crashed", "iter-0002/rollout").attempt == rollout_attempt  # type: ignore[union-attr]
    for it in range(3):  # same samples, same scores and advantages as the uninterrupted run
        for stage in ("rollout", "reward", "update"):
            name = {"rollout": "rollouts.parquet", "reward": "rewards.parquet", "update": "update.parquet"}
            a, b = _files(straight, f"iter-{it:04d}/{stage}"), _files(crashed, f"iter-{it:04d}/{stage}")
            assert a[name[stage]] == b[name[stage]], f"iteration {it} {stage}"
    assert _files(crashed, "ckpt/iter-0003")["policy/model.safetensors"] == final["policy/model.safetensors"]

    # a rerun of the finished run does nothing and returns the final checkpoint
    again = rl_loop(crashed, CFG, tp, None)
    assert again.checkpoint == out.checkpoint


def test_remax_samples_a_greedy_baseline_per_prompt_and_trains_on_the_others(
    prompts: tuple[Path, str],
) -> None:
    # before: adv_estimator=remax passed validation, then the update failed for lack of greedy rewards
    root, tp = prompts
    cfg = CFG.model_copy(
        update={
            "algorithm": CFG.algorithm.model_copy(update={"adv_estimator": "remax"}),
            "trainer": CFG.trainer.model_copy(update={"total_iterations": 1, "save_freq": 0}),
        }
    )
    ctx = _ctx(root, "remax")
    rl_loop(ctx, cfg, tp, None)
    store = ctx.store()
    rollouts = store.read_table(store.committed("remax", "iter-0000/rollout"), "rollouts.parquet")
    rewards = store.read_table(store.committed("remax", "iter-0000/reward"), "rewards.parquet")
    update = store.committed("remax", "iter-0000/update")
    assert update is not None
    # 2 prompts × (2 samples + 1 greedy baseline, sample_index 2)
    rows = rollouts.select(["group_id", "sample_index", "is_baseline"]).to_pylist()
    assert sorted((r["group_id"], r["sample_index"], r["is_baseline"]) for r in rows) == [
        (0, 0, False), (0, 1, False), (0, 2, True), (1, 0, False), (1, 1, False), (1, 2, True),
    ]  # fmt: skip
    # the update trains on the 4 samples only; advantage = score − its prompt's greedy score
    table = store.read_table(update, "update.parquet").to_pylist()
    assert len(table) == 4
    greedy = {
        r["group_id"]: s
        for r, s in zip(rows, rewards.column("score").to_pylist(), strict=True)
        if r["is_baseline"]
    }
    for r in table:
        assert r["advantages"] == pytest.approx([r["score"] - greedy[r["group_id"]]] * len(r["advantages"]))
    # the reward metrics describe the training samples; the baselines have their own
    samples = [
        s for r, s in zip(rows, rewards.column("score").to_pylist(), strict=True) if not r["is_baseline"]
    ]
    metrics = store.committed("remax", "iter-0000/reward").summary["metrics"]  # type: ignore[union-attr]
    assert metrics["critic/score/mean"] == pytest.approx(sum(samples) / 4)
    assert metrics["reward/baseline_score/mean"] == pytest.approx(sum(greedy.values()) / 2)


def test_gae_trains_a_critic_and_checkpoints_it(prompts: tuple[Path, str]) -> None:
    root, tp = prompts
    cfg = CFG.model_copy(
        update={
            "algorithm": CFG.algorithm.model_copy(update={"adv_estimator": "gae", "lam": 0.95}),
            "critic": CFG.critic.model_copy(update={"ppo_mini_batch_size": 1}),
            "trainer": CFG.trainer.model_copy(update={"total_iterations": 1, "save_freq": 0}),
        }
    )
    assert cfg.use_critic
    ctx = _ctx(root, "gae")
    out = rl_loop(ctx, cfg, tp, None)
    assert out.checkpoint.endswith("ckpt/iter-0001/manifest.json")
    files = _files(ctx, "ckpt/iter-0001")
    assert {"critic/config.json", "critic/model.safetensors", "policy/model.safetensors"} <= set(files)
    update = ctx.store().committed("gae", "iter-0000/update")
    assert update is not None
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "actor/pg_loss"):
        assert key in update.summary, key


def test_non_finite_reward_is_refused_and_nothing_after_it_commits(prompts: tuple[Path, str]) -> None:
    root, tp = prompts
    raw = CFG.model_dump()
    raw["reward"]["function"] = "tests.flows.rl_rewards:infinite"
    cfg = VerlFlowConfig.model_validate(raw)
    ctx = _ctx(root, "nonfinite")
    # the reward stage refuses +inf, naming the row; nothing of that iteration is committed
    with pytest.raises(
        RewardError, match=r"row group_id=0, sample_index=0 .*returned inf, expected a finite"
    ):
        rl_loop(ctx, cfg, tp, None)
    store = ctx.store()
    assert store.committed("nonfinite", "iter-0000/reward") is None
    assert store.committed("nonfinite", "iter-0000/update") is None
    assert list_checkpoints(store, "nonfinite") == []


def test_non_finite_scores_stop_the_update_before_commit(
    prompts: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # scores that reach the update stage non-finite (e.g. from a reward artifact written elsewhere):
    # the update names the tensor before any optimizer step
    root, tp = prompts
    real = ppo_module.scores_to_token_rewards
    monkeypatch.setattr(ppo_module, "scores_to_token_rewards", lambda s, m: real(s * float("inf"), m))
    ctx = _ctx(root, "nonfinite-update")
    with pytest.raises(
        NonFiniteError, match=r"ppo_update: .* contains NaN/Inf \(before any optimizer step\)"
    ):
        rl_loop(ctx, CFG, tp, None)
    store = ctx.store()
    assert store.committed("nonfinite-update", "iter-0000/reward") is not None
    assert store.committed("nonfinite-update", "iter-0000/update") is None
    assert list_checkpoints(store, "nonfinite-update") == []
