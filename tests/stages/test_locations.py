"""Stage locations: names written out by hand, parse(build(x)) == x, and None for every other name."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.floor.locations import (
    ITERATION_KINDS,
    ckpt_stage,
    eval_label,
    eval_stage,
    export_stage,
    generation_stage,
    iteration_stage,
    iteration_summaries,
    list_checkpoints,
    list_exports,
    parse_ckpt_stage,
    parse_export_stage,
    parse_generation_stage,
    parse_iteration_stage,
    validations,
)
from verl_core.store import ArtifactStore


def test_names_as_written_in_the_architecture() -> None:
    assert iteration_stage(0, "rollout") == "iter-0000/rollout"
    assert iteration_stage(3, "reward") == "iter-0003/reward"
    assert iteration_stage(42, "update") == "iter-0042/update"
    assert iteration_stage(12345, "val") == "iter-12345/val"  # more than 4 digits: not truncated
    assert ckpt_stage(2) == "ckpt/iter-0002"
    assert export_stage("ckpt/iter-0002") == "export/iter-0002"
    assert export_stage("sft") == "export/sft"
    assert eval_label("export/iter-0002") == "export-iter-0002"
    assert eval_stage(eval_label("ckpt/iter-0001")) == "eval/ckpt-iter-0001"


@pytest.mark.parametrize("iteration", [0, 1, 9999, 10000])
@pytest.mark.parametrize("kind", ITERATION_KINDS)
def test_parse_inverts_build(iteration: int, kind: str) -> None:
    assert parse_iteration_stage(iteration_stage(iteration, kind)) == (iteration, kind)  # type: ignore[arg-type]
    assert parse_ckpt_stage(ckpt_stage(iteration)) == iteration
    assert parse_export_stage(export_stage(ckpt_stage(iteration))) == ckpt_stage(iteration)
    assert parse_export_stage(export_stage("sft")) == "sft"


@pytest.mark.parametrize(
    "name",
    ["", "iter-0001", "iter-001/rollout", "iter-0001/rollouts", "iter-0001/rollout/x", "xiter-0001/val",
     "ckpt/iter-0001", "export/iter-0001", "sft", "template_pack", "eval/export-iter-0001", "iter-abcd/val"],
)  # fmt: skip
def test_parse_iteration_rejects_other_names(name: str) -> None:
    assert parse_iteration_stage(name) is None


@pytest.mark.parametrize(
    "name",
    ["ckpt/iter-001", "ckpt/iter-0001/", "ckpt/0001", "iter-0001/update", "export/iter-0001", "sft-ckpt"],
)
def test_parse_ckpt_rejects_other_names(name: str) -> None:
    assert parse_ckpt_stage(name) is None


@pytest.mark.parametrize(
    "name", ["export/iter-01", "export/sfts", "export/", "ckpt/iter-0001", "export/ckpt"]
)
def test_parse_export_rejects_other_names(name: str) -> None:
    assert parse_export_stage(name) is None


def test_generation_stages_of_dynamic_sampling() -> None:
    assert generation_stage(3, "rollout", 0) == "iter-0003/rollout/gen-0"
    assert generation_stage(3, "reward", 12) == "iter-0003/reward/gen-12"
    assert parse_generation_stage("iter-0003/reward/gen-12") == (3, "reward", 12)
    for other in (
        "iter-0003/reward",
        "iter-0003/update/gen-1",
        "iter-0003/reward/gen-",
        "iter-3/rollout/gen-0",
    ):
        assert parse_generation_stage(other) is None
    assert parse_iteration_stage("iter-0003/rollout/gen-0") is None  # not the one-batch stage
    with pytest.raises(ValueError, match="kind must be one of"):
        generation_stage(1, "update", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="generation batch must be >= 0"):
        generation_stage(1, "rollout", -1)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        iteration_stage(1, "rollouts")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        ckpt_stage(-1)
    with pytest.raises(ValueError, match="only a checkpoint"):
        export_stage("iter-0001/update")


def test_listings_read_committed_manifests(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))

    def commit(stage: str, **summary: object) -> None:
        store.open_stage("r", stage).commit(summary=summary)

    for it in (3, 1, 10):
        commit(ckpt_stage(it))
    commit(export_stage("ckpt/iter-0003"))
    commit(export_stage("sft"))
    commit(iteration_stage(0, "val"), accuracy=0.25, iteration_lineage="a")
    commit(iteration_stage(2, "val"), accuracy=0.5, iteration_lineage="a")
    commit(iteration_stage(1, "val"), accuracy=0.75, iteration_lineage="b")  # another policy lineage
    commit(iteration_stage(1, "reward"), accuracy=1.0, iteration_lineage="a")  # not a validation
    commit("sft-ckpt")
    assert list_checkpoints(store, "r") == [1, 3, 10]  # numeric order
    assert sorted(list_exports(store, "r")) == ["export/iter-0003", "export/sft"]
    assert validations(store, "r", "a") == {0: 0.25, 2: 0.5}
    assert validations(store, "r", "b") == {1: 0.75}
    assert validations(store, "r", "c") == {}
    commit(iteration_stage(12, "rollout"), rate=0.5)
    commit(iteration_stage(2, "rollout"), rate=0.25)
    assert list(iteration_summaries(store, "r", "rollout").items()) == [
        (2, {"rate": 0.25}),
        (12, {"rate": 0.5}),
    ]
    assert iteration_summaries(store, "r", "update") == {}
