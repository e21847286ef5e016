"""DAPO dynamic sampling (``algorithm.filter_groups``) in the RL loop flow on a tiny model: generation
batches until the iteration holds ``data.train_batch_size`` informative groups, the cap with its
warning, dropped groups kept in the artifacts and marked, and a run killed mid-iteration that resumes
to the same prompts and samples.

The reward (``uniform_when_even``) gives every sample of a prompt whose ground truth's character codes
sum to an even number the same 0.0 (its group is dropped), the others a hash of the text (kept)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import flows.rl as rl_flow
from flows.rl import rl_loop
from flows.sampling import combine_batch_metrics
from stages.floor.locations import generation_stage
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig
from verl_core.errors import DataError
from verl_core.runtime.run import RunContext

B = 2  # prompts per generation batch = informative groups wanted per iteration
CFG = VerlFlowConfig.model_validate(
    {
        "data": {
            "arithmetic_train_size": 64,
            "arithmetic_val_size": 8,
            "train_batch_size": B,
            "max_response_length": 16,
            "truncation": "right",
        },
        "model": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "actor": {"lr": 1e-3, "ppo_mini_batch_size": 1},
        "rollout": {"n": 2},
        "reward": {"scorers": [{"name": "function"}], "function": "tests.flows.rl_rewards:uniform_when_even"},
        "algorithm": {"filter_groups": {"enable": True, "metric": "score", "max_num_gen_batches": 0}},
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
    root = tmp_path_factory.mktemp("dapo")
    ctx = RunContext(run_id="data", store_url=str(root))
    return root, template_pack.fn(ctx, CFG.data, CFG.model, preprocess.fn(ctx, CFG.data))


def _batches(ctx: RunContext, iteration: int) -> list[dict[str, Any]]:
    """Per committed generation batch of ``iteration``: its cursor, files and group filter rows."""
    store, out = ctx.store(), []
    for k in range(100):
        r = store.committed(ctx.run_id, generation_stage(iteration, "rollout", k))
        w = store.committed(ctx.run_id, generation_stage(iteration, "reward", k))
        if r is None or w is None:
            break
        rows = store.read_table(w, "group_filter.parquet").to_pylist()
        prompts = store.read_table(r, "rollouts.parquet").column("prompt_index").to_pylist()
        files = {f.name: f.sha256 for f in (*r.files, *w.files)}
        out.append({"cursor": r.summary["prompt_cursor"], "filter": w.summary["filter"], "rows": rows,
                    "prompts": prompts, "files": files})  # fmt: skip
    return out


def test_oversamples_until_the_batch_holds_enough_informative_groups(prompts: tuple[Path, str]) -> None:
    root, tp = prompts
    ctx = RunContext(run_id="full", store_url=str(root))
    rl_loop(ctx, CFG, tp, None)
    store, cursor, extra = ctx.store(), 0, 0
    for it in range(3):
        batches = _batches(ctx, it)
        assert batches, f"iteration {it} has no generation batches"
        # the cursor moves on by one batch of B prompts per generation batch, across iterations
        assert [b["cursor"] for b in batches] == [cursor + B * k for k in range(len(batches))]
        cursor += B * len(batches)
        extra += len(batches) - 1
        kept_groups = sum(b["filter"]["kept_groups"] for b in batches)
        assert kept_groups == B  # no cap: the iteration is full
        for b in batches:
            # group ids continue across the batches: batch k holds groups k·B … k·B + B − 1
            k = batches.index(b)
            assert {r["group_id"] for r in b["rows"]} == {k * B + g for g in range(B)}
            for g in {r["group_id"] for r in b["rows"]}:
                values = {r["value"] for r in b["rows"] if r["group_id"] == g}
                kept = {r["kept"] for r in b["rows"] if r["group_id"] == g}
                assert len(kept) == 1  # a group is kept or dropped whole
                if len(values) == 1:  # samples agree: dropped, but still in the artifacts
                    assert kept == {False}
        update = store.committed("full", f"iter-{it:04d}/update")
        assert update is not None and update.summary["kept_groups"] == B
        assert update.summary["num_gen_batches"] == len(batches)
        trained = store.read_table(update, "update.parquet").column("group_id").to_pylist()
        marked = [r["group_id"] for b in batches for r in b["rows"] if r["kept"]]
        assert trained == marked  # the update trains on exactly the kept rows, in batch order
    assert extra > 0, "no iteration needed a second generation batch: the test reward drops too few"
    assert store.committed("full", "iter-0000/rollout") is None  # not the one-batch stage names
    # which groups agree depends on the prompts' ground truths alone (not on the policy), so the run is
    # fixed by the prompt stream: (cursor, kept groups) per generation batch of each iteration
    expected = {
        0: [(0, 1), (2, 0), (4, 1)],  # gen-1: both groups agree; gen-2: 2 informative, 1 wanted
        1: [(6, 1), (8, 1)],
        2: [(10, 2)],
    }
    for it, batches in expected.items():
        assert [(b["cursor"], b["filter"]["kept_groups"]) for b in _batches(ctx, it)] == batches
    surplus = _batches(ctx, 0)[2]["filter"]  # informative but over the iteration's need: dropped too
    assert (surplus["informative_groups"], surplus["kept_groups"], surplus["wanted_groups"]) == (2, 1, 1)


def test_cap_warns_and_trains_on_the_smaller_batch_and_fails_with_none(
    prompts: tuple[Path, str], caplog: pytest.LogCaptureFixture
) -> None:
    root, tp = prompts
    fg = CFG.algorithm.filter_groups.model_copy(update={"max_num_gen_batches": 1})
    cfg = CFG.model_copy(update={"algorithm": CFG.algorithm.model_copy(update={"filter_groups": fg})})
    ctx = RunContext(run_id="capped", store_url=str(root))
    # iteration 0's one batch holds 1 informative group of 2 (as in the uncapped run): a warning, and
    # the update trains on that group; iteration 1's batch (cursor 2) holds none: the loop fails
    with caplog.at_level(logging.WARNING), pytest.raises(DataError, match="iteration 1: no prompt group"):
        rl_loop(ctx, cfg, tp, None)
    assert "iteration 0: 1 of 2 informative prompt groups after 1 generation batches" in caplog.text
    assert "max_num_gen_batches=1" in caplog.text
    assert [(b["cursor"], b["filter"]["kept_groups"]) for b in _batches(ctx, 0)] == [(0, 1)]
    update = ctx.store().committed("capped", "iter-0000/update")
    assert update is not None and update.summary["kept_groups"] == 1
    assert len(ctx.store().read_table(update, "update.parquet")) == 2  # 1 group × rollout.n = 2
    assert ctx.store().committed("capped", "iter-0001/update") is None


def test_killed_mid_iteration_resumes_to_the_same_prompts(
    prompts: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tp = prompts
    straight = RunContext(run_id="full", store_url=str(root))  # the first test's uninterrupted run
    if not _batches(straight, 0):
        rl_loop(straight, CFG, tp, None)
    # the first iteration after a checkpoint that needed a second generation batch
    target = next(it for it in (1, 2) if len(_batches(straight, it)) > 1)

    crashed = RunContext(run_id="crashed", store_url=str(root))
    real_rollout = rl_flow.rollout

    def dying_rollout(*args: Any, **kwargs: Any) -> Any:
        if args[4] == target and kwargs.get("gen_batch") == 1:
            raise KeyboardInterrupt("killed")
        return real_rollout(*args, **kwargs)

    monkeypatch.setattr(rl_flow, "rollout", dying_rollout)
    with pytest.raises(KeyboardInterrupt):
        rl_loop(crashed, CFG, tp, None)
    assert len(_batches(crashed, target)) == 1  # gen-0 committed, killed before gen-1
    monkeypatch.setattr(rl_flow, "rollout", real_rollout)

    rl_loop(crashed, CFG, tp, None)
    for it in range(3):  # same cursors, prompts, samples, scores and filters as the uninterrupted run
        a, b = _batches(straight, it), _batches(crashed, it)
        assert [x["cursor"] for x in a] == [x["cursor"] for x in b]
        assert [x["prompts"] for x in a] == [x["prompts"] for x in b]
        for x, y in zip(a, b, strict=True):
            for name in ("rollouts.parquet", "rewards.parquet", "group_filter.parquet"):
                assert x["files"][name] == y["files"][name], f"iteration {it} {name}"


class _Spy:
    """A tracker that records log_metrics calls (every other call does nothing)."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, list[str]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, list(metrics)))

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def test_each_metric_is_logged_once_per_step(
    prompts: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # iteration 0 takes three generation batches (the first test's expected cursors 0, 2, 4); before,
    # each batch's rollout and reward stages logged their metrics at step 0: timing_s/rollout,
    # critic/score/std, reward/accuracy ... three times each
    root, tp = prompts
    spy = _Spy()
    monkeypatch.setattr(RunContext, "tracker", lambda self: spy)
    one = CFG.model_copy(update={"trainer": CFG.trainer.model_copy(update={"total_iterations": 1})})
    ctx = RunContext(run_id="logged", store_url=str(root))
    rl_loop(ctx, one, tp, None)
    assert len(_batches(ctx, 0)) == 3
    names = [n for step, logged in spy.logged if step == 0 for n in logged]
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert repeated == []
    for name in ("timing_s/rollout", "timing_s/reward", "perf/gen_tokens_per_s", "critic/score/std",
                 "reward/accuracy", "response_length/max", "critic/score/mean"):  # fmt: skip
        assert name in names, name


def test_batch_metrics_combine_as_one_batch_of_all_samples() -> None:
    # batch A: scores [0, 1] (mean 0.5, std 0.5, max 1), 2 samples, 3 s, 60 tokens/s (180 tokens);
    # batch B: scores [1, 1, 1, 1] (mean 1, std 0, max 1, min 1), 4 samples, 1 s, 20 tokens/s (20 tokens)
    names = ("critic/score/mean", "critic/score/std", "critic/score/min", "critic/score/max",
             "timing_s/rollout", "perf/gen_tokens_per_s", "reward/errors", "train/epoch")  # fmt: skip
    a = dict(zip(names, (0.5, 0.5, 0.0, 1.0, 3.0, 60.0, 1.0, 0.0), strict=True))
    b = dict(zip(names, (1.0, 0.0, 1.0, 1.0, 1.0, 20.0, 2.0, 1.0), strict=True))
    out = combine_batch_metrics([(a, 2), (b, 4)])
    # all six scores [0, 1, 1, 1, 1, 1]: mean 5/6, population std sqrt(5/6 - 25/36) = sqrt(5)/6
    assert out["critic/score/mean"] == pytest.approx(5 / 6)
    assert out["critic/score/std"] == pytest.approx(5**0.5 / 6)
    assert (out["critic/score/min"], out["critic/score/max"]) == (0.0, 1.0)
    assert out["timing_s/rollout"] == 4.0 and out["reward/errors"] == 3.0  # seconds and counts add up
    assert out["perf/gen_tokens_per_s"] == pytest.approx(200 / 4)  # 200 tokens in 4 s
    assert out["train/epoch"] == 1.0  # the epoch the last batch reached
