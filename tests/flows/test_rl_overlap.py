"""One-step off-policy overlap (``trainer.rollout_ahead=1``) on the tiny RL loop of
``test_rl_resume``: iteration i+1's rollout is sampled from policy i while update i runs, the rows say
so, the version guard lets exactly that lag through, and a run killed in an update while the next
rollout was generated resumes to the artifacts of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import flows.rl as rl_flow
from flows.rl import rl_iterations, rl_loop
from stages.floor.artifacts import check_policy_lag
from stages.floor.locations import list_checkpoints
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from tests.flows.test_rl_resume import CFG
from verl_core.config import VerlFlowConfig
from verl_core.errors import DataError
from verl_core.runtime.run import RunContext

AHEAD = CFG.model_copy(
    update={
        "trainer": CFG.trainer.model_copy(update={"rollout_ahead": 1}),
        "rollout": CFG.rollout.model_copy(update={"share_weights": False}),
    }
)
STAGE_FILE = {"rollout": "rollouts.parquet", "reward": "rewards.parquet", "update": "update.parquet"}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("overlap")
    ctx = RunContext(run_id="data", store_url=str(root))
    return root, template_pack.fn(ctx, CFG.data, CFG.model, preprocess.fn(ctx, CFG.data))


@pytest.fixture(scope="module")
def straight(prompts: tuple[Path, str]) -> RunContext:
    """An uninterrupted 3-iteration run with the overlap, checkpoints after every iteration."""
    root, tp = prompts
    ctx = RunContext(run_id="straight", store_url=str(root))
    out = rl_loop(ctx, AHEAD, tp, None)
    assert out.checkpoint.endswith("ckpt/iter-0003/manifest.json")
    assert "weight_sync" in out.timing_s  # the boundary syncs ran (iterations 0 and 1)
    return ctx


def _files(ctx: RunContext, stage: str) -> dict[str, str]:
    m = ctx.store().committed(ctx.run_id, stage)
    assert m is not None, f"{stage} of {ctx.run_id} is not committed"
    return {f.name: f.sha256 for f in m.files}


def _versions(ctx: RunContext, it: int) -> set[int]:
    store = ctx.store()
    m = store.committed(ctx.run_id, f"iter-{it:04d}/rollout")
    assert m is not None
    return set(store.read_table(m, "rollouts.parquet").column("policy_version").to_pylist())


def test_ahead_rollouts_carry_the_previous_version_and_pass_the_guard(straight: RunContext) -> None:
    # iteration 0 has no ahead rollout (version 0); rollout i+1 is sampled while update i runs, by
    # the engine still at version i: 1 → 0, 2 → 1
    assert [_versions(straight, it) for it in range(3)] == [{0}, {0}, {1}]
    store = straight.store()
    for it in range(3):  # every update moved the trainer from version i to i+1
        update = store.committed("straight", f"iter-{it:04d}/update")
        assert update is not None and update.summary["policy_version"] == it + 1
    rows = store.read_table(store.committed("straight", "iter-0002/rollout"), "rollouts.parquet")  # type: ignore[arg-type]
    # update 2 runs with the trainer at version 2 on rows of version 1: lag 1
    check_policy_lag(rows, 2, 1, 2, "iter-0002/rollout")  # rollout_ahead=1: allowed
    with pytest.raises(DataError, match="sampled with policy version 1, but the trainer is at version 2"):
        check_policy_lag(rows, 2, 0, 2, "iter-0002/rollout")  # on-policy: refused


def test_kill_in_the_update_beside_the_ahead_rollout_resumes_identically(
    prompts: tuple[Path, str], straight: RunContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tp = prompts
    crashed = RunContext(run_id="crashed", store_url=str(root))
    real_update = rl_flow.ppo_update

    def dying_update(ctx: RunContext, cfg: VerlFlowConfig, r: str, w: str, it: int) -> Any:
        if it == 1:  # killed while rollout 2 is sampled beside it (the engine holding version 1)
            raise KeyboardInterrupt("killed")
        return real_update(ctx, cfg, r, w, it)

    monkeypatch.setattr(rl_flow, "ppo_update", dying_update)
    with pytest.raises(KeyboardInterrupt):
        rl_loop(crashed, AHEAD, tp, None)
    store = crashed.store()
    # the checkpoint after iteration 0 came after its ahead rollout (iteration 1) was committed; the
    # kill left rollout 2 committed (the loop waits for it) and update 1 not
    assert list_checkpoints(store, "crashed") == [1]
    assert store.committed("crashed", "iter-0002/rollout") is not None
    assert store.committed("crashed", "iter-0001/update") is None
    attempts = {it: store.committed("crashed", f"iter-{it:04d}/rollout").attempt for it in (1, 2)}  # type: ignore[union-attr]
    monkeypatch.setattr(rl_flow, "ppo_update", real_update)

    out = rl_loop(crashed, AHEAD, tp, None)
    assert out.checkpoint.endswith("ckpt/iter-0003/manifest.json")
    for it in (1, 2):  # the committed rollouts were reused, not sampled again
        assert store.committed("crashed", f"iter-{it:04d}/rollout").attempt == attempts[it]  # type: ignore[union-attr]
    for it in range(3):  # same samples, scores, advantages and final weights as the uninterrupted run
        for stage, name in STAGE_FILE.items():
            a, b = _files(straight, f"iter-{it:04d}/{stage}"), _files(crashed, f"iter-{it:04d}/{stage}")
            assert a[name] == b[name], f"iteration {it} {stage}"
    final = _files(straight, "ckpt/iter-0003")["policy/model.safetensors"]
    assert _files(crashed, "ckpt/iter-0003")["policy/model.safetensors"] == final


def test_the_loop_without_tasks_overlaps_in_a_plain_thread_to_the_same_artifacts(
    prompts: tuple[Path, str], straight: RunContext
) -> None:
    # as_tasks=False (benchmarks' baseline): a ThreadPoolExecutor instead of the flow's task runner
    root, tp = prompts
    ctx = RunContext(run_id="fn", store_url=str(root))
    out = rl_iterations(ctx, AHEAD, tp, None, as_tasks=False)
    assert out.checkpoint.endswith("ckpt/iter-0003/manifest.json")
    for it in range(3):
        for stage, name in STAGE_FILE.items():
            a, b = _files(straight, f"iter-{it:04d}/{stage}"), _files(ctx, f"iter-{it:04d}/{stage}")
            assert a[name] == b[name], f"iteration {it} {stage}"


def test_the_ahead_rollout_generates_while_the_update_runs(
    prompts: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the update of iteration 0 waits until rollout 1 is generating: a loop running them one after
    # the other would time out here. Each side runs on its share of the torch threads.
    import threading

    import torch

    import stages.rollout as rollout_module

    root, tp = prompts
    cfg = AHEAD.model_copy(
        update={"trainer": AHEAD.trainer.model_copy(update={"total_iterations": 2, "save_freq": 0})}
    )
    threads = torch.get_num_threads()
    generating = threading.Event()
    seen: dict[str, Any] = {}
    real_generate, real_update = rollout_module.sharded_rollouts, rl_flow.ppo_update

    calls: list[int] = []

    def generate(engine: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(engine.policy_version)
        if len(calls) == 2:  # iteration 0's rollout comes first, alone; this is iteration 1's, ahead
            seen["rollout"] = (engine.policy_version, torch.get_num_threads())
            generating.set()
        return real_generate(engine, *args, **kwargs)

    def update(ctx: RunContext, c: VerlFlowConfig, r: str, w: str, it: int) -> Any:
        if it == 0:
            assert generating.wait(timeout=60), "rollout 1 did not start beside update 0"
            seen["update"] = torch.get_num_threads()
        return real_update(ctx, c, r, w, it)

    monkeypatch.setattr(rollout_module, "sharded_rollouts", generate)
    monkeypatch.setattr(rl_flow, "ppo_update", update)
    rl_loop(RunContext(run_id="beside", store_url=str(root)), cfg, tp, None)
    # rollout 1 sampled policy 0 (the engine held it while the trainer moved to 1); threads split
    assert seen == {"rollout": (0, max(1, threads // 2)), "update": max(1, threads - threads // 2)}
    assert torch.get_num_threads() == threads  # restored
    assert calls == [0, 0]  # iteration 1 was not sampled again by run_iteration (a committed skip)
