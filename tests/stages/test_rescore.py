"""Rescore stages on a hand-made run (no model): five GSM8K rows per table, scored by the real reward
stage (training iterations 0 and 1, dynamic sampling's two generation batches of iteration 2), as
validation (greedy + sampled) and eval score them. Rescoring with the run's own settings reproduces
every stored rewards file byte for byte; with ``reward.gsm8k_method=flexible`` exactly rows 1 and 4
of every table change. The run's own files are never touched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pytest

from stages.floor.locations import eval_stage, generation_stage, iteration_stage
from stages.floor.rescore import (
    parse_iterations,
    plan_rescore,
    read_rescore_report,
    rescore_settings,
    reward_config_hash,
)
from stages.floor.scorers import score_batch
from stages.rescore import rescore, rescore_report
from stages.reward import reward
from verl_core.config import VerlFlowConfig
from verl_core.errors import ArtifactNotFoundError, ConfigError
from verl_core.reward import batch_from_columns, rewards_table
from verl_core.runtime.run import RunContext
from verl_core.runtime.tracking import MlflowTracker
from verl_core.store import ArtifactStore

RUN = "hand"
CFG = VerlFlowConfig.model_validate({"tracking": {"enabled": False}})  # reward: rule, gsm8k strict
MAX_LEN = CFG.data.max_response_length
# (response, ground truth); verl_core.reward.rules: strict reads the last '#### N', flexible the last number
ROWS = [
    ("#### 18", "18"),  # 0: strict 18 ✓ (1.0), flexible 18 ✓ (1.0)          unchanged
    ("The answer is 18", "18"),  # 1: strict none ✗ (0), flexible 18 ✓ (1.0)  F → T
    ("#### 17", "18"),  # 2: strict 17 ✗ (0), flexible 17 ✗ (0)               unchanged
    ("I think 17", "18"),  # 3: strict none ✗ (0), flexible 17 ✗ (0): only the extracted answer changes
    ("#### 18 or 19", "18"),  # 4: strict 18 ✓ (1.0), flexible 19 ✗ (0)      T → F
]
CHANGED = {1, 4}


def _rollouts(iteration: int) -> pa.Table:
    n = len(ROWS)
    return pa.table(
        {
            "iteration": [iteration] * n,
            "group_id": list(range(n)),
            "sample_index": [0] * n,
            "prompt_index": list(range(n)),
            "data_source": ["openai/gsm8k"] * n,
            "ground_truth": [truth for _, truth in ROWS],
            "prompt_text": [f"question {i}" for i in range(n)],
            "prompt_ids": [[1, 2]] * n,
            "response_ids": [[3]] * n,
            "response_text": [response for response, _ in ROWS],
            "logprobs": [[-0.5]] * n,
            "finish_reason": ["stop"] * n,
            "prompt_length": [2] * n,
            "response_length": [1] * n,
            "policy_version": [iteration] * n,
            "is_baseline": [False] * n,
            "loss_mask": pa.nulls(n, pa.list_(pa.int8())),
            "turns": pa.nulls(n),
        }
    )


def _scored(stage: object, prefix: str) -> None:
    """Write rollouts and their rewards as validation and eval do (``score_batch`` on the table)."""
    rollouts = _rollouts(1)
    batch = batch_from_columns(rollouts)
    result = score_batch(CFG.reward, CFG.sandbox, batch, MAX_LEN)
    stage.write_table(f"{prefix}rollouts.parquet", rollouts, "rollouts")  # type: ignore[attr-defined]
    stage.write_table(f"{prefix}rewards.parquet", rewards_table(batch, result), "rewards")  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunContext:
    ctx = RunContext(run_id=RUN, store_url=str(tmp_path_factory.mktemp("rescore")))
    store = ctx.store()
    store.write_run_record(RUN, CFG.model_dump(mode="json"), CFG.config_hash())
    for where, gen in [(0, None), (1, None), (2, 0), (2, 1)]:
        name = iteration_stage(where, "rollout") if gen is None else generation_stage(where, "rollout", gen)
        stage = store.open_stage(RUN, name, params={"gen": gen})
        stage.write_table("rollouts.parquet", _rollouts(where), "rollouts")
        uri = stage.commit(summary={"seconds": 2.0})
        extra = {} if gen is None else {"gen_batch": gen, "wanted_groups": 2}
        reward.fn(ctx, CFG.reward, uri, where, MAX_LEN, sandbox=CFG.sandbox, **extra)
    val = store.open_stage(RUN, iteration_stage(1, "val"))
    _scored(val, "")
    _scored(val, "sampled/")
    val.commit(summary={"accuracy": 0.4})
    ev = store.open_stage(RUN, eval_stage("export-iter-0002"))
    _scored(ev, "greedy/")
    ev.commit()
    return ctx


def _own_files(store: ArtifactStore) -> dict[str, str]:
    """sha256 of every file of the run outside rescore/."""
    run_dir = store.run_dir(RUN)
    return {
        p: hashlib.sha256(store.cat(p)).hexdigest()
        for p in store.fs.find(run_dir)
        if not p.startswith(f"{run_dir}/rescore/")
    }


def _tables(
    store: ArtifactStore, plan_targets: object, uris: list[str]
) -> list[tuple[str, pa.Table, pa.Table]]:
    """(source, stored rewards, rescored rewards) of every table of the plan."""
    out = []
    for target, uri in zip(plan_targets, uris, strict=True):  # type: ignore[call-overload]
        old, new = store.read_manifest(target.rewards_uri), store.read_manifest(uri)
        for _, rewards_file in target.tables:
            out.append(
                (
                    f"{target.stage}:{rewards_file}",
                    store.read_table(old, rewards_file),
                    store.read_table(new, rewards_file),
                )
            )
    return out


def test_same_reward_reproduces_the_stored_rewards_byte_for_byte(run: RunContext) -> None:
    store = run.store()
    before = _own_files(store)
    plan = plan_rescore(store, RUN, CFG, [], "same", None)
    assert [t.stage for t in plan.targets] == [
        "iter-0000/reward",
        "iter-0001/reward",
        "iter-0001/val",
        "iter-0002/reward/gen-0",
        "iter-0002/reward/gen-1",
        "eval/export-iter-0002",
    ]
    uris = rescore.fn(run, CFG.reward, CFG.sandbox, plan, MAX_LEN)
    for target, uri in zip(plan.targets, uris, strict=True):
        old, new = store.read_manifest(target.rewards_uri), store.read_manifest(uri)
        assert new.stage == f"rescore/same/{target.stage}"
        assert (
            set(new.inputs) == {"rollout", "rewards"}
            and new.summary["reward_config_hash"] == plan.reward_config_hash
        )
        for _, rewards_file in target.tables:
            assert new.file(rewards_file).sha256 == old.file(rewards_file).sha256, (
                target.stage,
                rewards_file,
            )
    report = read_rescore_report(store, rescore_report.fn(run, plan, uris))
    assert len(report.parts) == 7  # training 2, val greedy + sampled, 2 generation batches, eval greedy
    assert report.total.agreement == 1.0 and report.total.scores_changed == 0 and report.total.rows == 35
    m = store.committed(RUN, "rescore/same/report")
    assert m is not None and store.read_table(m, "disagreements.parquet").num_rows == 0
    assert _own_files(store) == before


def test_a_changed_rule_changes_exactly_the_rows_it_should(run: RunContext) -> None:
    store = run.store()
    before = _own_files(store)
    new = rescore_settings(CFG, ["reward.gsm8k_method=flexible"])
    plan = plan_rescore(store, RUN, new, ["reward.gsm8k_method=flexible"], None, None)
    assert plan.name == reward_config_hash(new.reward, new.sandbox)[:8]
    uris = rescore.fn(run, new.reward, new.sandbox, plan, MAX_LEN)
    for source, old, rescored in _tables(store, plan.targets, uris):
        o, n = old.to_pydict(), rescored.to_pydict()
        flipped = {i for i in range(len(ROWS)) if o["correct"][i] != n["correct"][i]}
        rescored_scores = {i for i in range(len(ROWS)) if o["score"][i] != n["score"][i]}
        assert flipped == rescored_scores == CHANGED, source
        assert (o["extracted_answer"][3], n["extracted_answer"][3]) == (None, "17"), source
        assert [n["correct"][i] for i in range(len(ROWS))] == [True, True, False, False, False], source
    # a rerun skips every committed stage (same attempts)
    attempts = {u: store.read_manifest(u).attempt for u in uris}
    assert rescore.fn(run, new.reward, new.sandbox, plan, MAX_LEN) == uris
    assert {u: store.read_manifest(u).attempt for u in uris} == attempts

    report = read_rescore_report(store, rescore_report.fn(run, plan, uris))
    # every table: row 0 TT, row 4 TF, row 1 FT, rows 2-3 FF; scores 1,0,0,0,1 → 1,1,0,0,0
    for part in report.parts:
        assert (part.tt, part.tf, part.ft, part.ff, part.scores_changed) == (1, 1, 1, 2, 2), part.source
        assert part.agreement == pytest.approx(3 / 5) and part.rows == 5
        assert part.accuracy_old == part.accuracy_new == pytest.approx(2 / 5)
        assert part.score_old_mean == part.score_new_mean == pytest.approx(2 / 5)
    assert [p.split for p in report.parts] == [
        "train", "train", "val", "val/sampled", "train", "train", "eval/greedy",
    ]  # fmt: skip
    assert (report.total.rows, report.total.tf, report.total.ft) == (35, 7, 7)
    m = store.committed(RUN, f"rescore/{plan.name}/report")
    assert m is not None
    top = store.read_table(m, "disagreements.parquet").to_pydict()
    assert top["group_id"] == [1, 4] * 7  # per table: the flipped rows, by index (|diff| 1 each)
    assert "| iter-0001/val/sampled | 5 |" in store.read_bytes(m, "report.md").decode()
    assert store.read_bytes(m, "plots/accuracy.png")[:4] == b"\x89PNG"
    assert _own_files(store) == before


def test_one_name_one_reward_config(run: RunContext) -> None:
    store = run.store()
    plan = plan_rescore(store, RUN, CFG, [], "taken", "0:1")
    rescore.fn(run, CFG.reward, CFG.sandbox, plan, MAX_LEN)
    new = rescore_settings(CFG, ["reward.format_score=0.1"])
    with pytest.raises(
        ConfigError, match=r"^--name taken: rescore 'taken' of run 'hand' holds reward config"
    ):
        plan_rescore(store, RUN, new, [], "taken", None)


def test_plan_iterations_and_refusals(run: RunContext) -> None:
    store = run.store()
    # A:B is A <= i < B; eval stages only without --iterations
    plan = plan_rescore(store, RUN, CFG, [], "x", "1:2")
    assert [t.stage for t in plan.targets] == ["iter-0001/reward", "iter-0001/val"]
    assert [t.stage for t in plan_rescore(store, RUN, CFG, [], "x", "2:").targets] == [
        "iter-0002/reward/gen-0",
        "iter-0002/reward/gen-1",
    ]
    spans = [parse_iterations(text) for text in ("3:7", "3:", ":2", "4")]
    assert spans == [(3, 7), (3, None), (0, 2), (4, 5)]
    for bad in ("7:3", "3:3", "a:b", ":", "", "1:2:3"):
        with pytest.raises(ConfigError, match=r"^--iterations: got"):
            parse_iterations(bad)
    with pytest.raises(ArtifactNotFoundError, match="no committed rewards to rescore in iterations 5:"):
        plan_rescore(store, RUN, CFG, [], "x", "5:")
    with pytest.raises(ConfigError, match=r"^'actor.lr': a rescore changes only reward\.\* and sandbox\.\*"):
        rescore_settings(CFG, ["reward.score=2", "actor.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"^--name: got 'a/b'"):
        plan_rescore(store, RUN, CFG, [], "a/b", None)


def test_report_is_logged_to_an_mlflow_child_of_the_run(run: RunContext, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from flows.runs import find_mlflow_run

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = MlflowTracker.start(uri, "rescore-test", RUN, {}, str(tmp_path))
    tracked = run.model_copy(update={"tracking_uri": uri, "mlflow_run_id": parent.run_id})
    new = rescore_settings(CFG, ["reward.gsm8k_method=flexible"])
    plan = plan_rescore(run.store(), RUN, new, [], "tracked", "0:2")
    rescore_report.fn(tracked, plan, rescore.fn(tracked, new.reward, new.sandbox, plan, MAX_LEN))

    client = MlflowClient(tracking_uri=uri)
    [child] = client.search_runs(
        [client.get_run(parent.run_id).info.experiment_id], "tags.`verl_flow.rescore` = 'tracked'"
    )
    assert child.data.tags["mlflow.parentRunId"] == parent.run_id
    history = client.get_metric_history(child.info.run_id, "rescore/train/accuracy_new")
    assert [(m.step, m.value) for m in history] == [(0, 0.4), (1, 0.4)]  # rows 0 and 1 of 5 correct
    assert client.get_metric_history(child.info.run_id, "rescore/val/agreement")[0].value == pytest.approx(
        0.6
    )
    logged = {f.path for f in client.list_artifacts(child.info.run_id, "rescore")}
    assert {"rescore/report.md", "rescore/plots", "rescore/report.json"} <= logged
    assert find_mlflow_run(uri, "rescore-test", RUN) == parent.run_id  # the run's own lookup: the parent
