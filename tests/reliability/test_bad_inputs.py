"""The bad-input corpus (``tests/data/bad/``, see its README): every bad input gets one clear error
naming the file, row/line and field (or, where the data policy drops rows, a counted drop), through
the stage or entry point a user would hit, and nothing already committed is damaged.

This is the systematic layer over the unit tests of each module: one table, every case through the
real stage function against a store that already holds a committed stage of the same run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flows.cli import app
from stages.floor.policy import build_policy
from stages.preprocess import preprocess
from stages.reward import reward
from stages.template_pack import template_pack
from verl_core.config import DataConfig, ModelConfig, RewardConfig, SandboxConfig
from verl_core.errors import ArtifactSchemaError, DataError
from verl_core.models.loading import ModelLoadError
from verl_core.reward import RewardError
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore, get_schema

BAD = Path(__file__).resolve().parents[1] / "data" / "bad"


class Committed(NamedTuple):
    """A stage committed before a bad input is tried: its manifest's sha256 and its files."""

    stage: str
    manifest_sha: str
    files: dict[str, str]

    @classmethod
    def of(cls, store: ArtifactStore, run_id: str, stage: str) -> Committed:
        m = store.committed(run_id, stage)
        assert m is not None
        return cls(
            stage,
            store.manifest_sha256(store.manifest_uri(run_id, stage)),
            {f.name: f.sha256 for f in m.files},
        )

    def intact(self, store: ArtifactStore, run_id: str) -> None:
        after = Committed.of(store, run_id, self.stage)
        assert after == self, f"{self.stage} was changed by a failed attempt"
        m = store.committed(run_id, self.stage)
        assert m is not None
        for f in m.files:
            store.read_bytes(m, f.name)  # sha256 still matches


# ------------------------------------------------------------------------------------------------
# Raw data: strict mode names file, line and field; lenient mode drops and counts


class RowCase(NamedTuple):
    file: str
    field: str
    reason: str
    detail: str  # regex of the detail


ROW_CASES = [
    RowCase("malformed_json.jsonl", "<line>", "undecodable", r"not valid JSON"),
    RowCase("wrong_types.jsonl", "question", "wrong_type", r"expected a string, got list"),
    RowCase("empty_strings.jsonl", "question", "empty_field", r"empty"),
    RowCase("nan_inf.jsonl", "answer", "wrong_type", r"expected a string, got NaN"),
    RowCase("infinity.jsonl", "answer", "wrong_type", r"expected a string, got Infinity"),
    RowCase("missing_ground_truth.jsonl", "answer", "no_ground_truth", r"no match for"),
    RowCase("missing_field.jsonl", "answer", "missing_field", r"missing"),
    RowCase("non_utf8.jsonl", "<line>", "undecodable", r"not valid UTF-8"),
]


def _data(file: str, strict: bool) -> DataConfig:
    return DataConfig(source="gsm8k", train_files=[str(BAD / file)], strict=strict, val_holdout_rows=1)


@pytest.fixture
def ctx(tmp_path: Path) -> RunContext:
    """Run ``r`` with a committed preprocess stage (three good rows) already in the store."""
    c = RunContext(run_id="r", store_url=str(tmp_path / "store"))
    good = tmp_path / "good.jsonl"
    good.write_text("".join((BAD / "missing_field.jsonl").read_text().splitlines(True)[:3]))
    preprocess.fn(c, DataConfig(source="gsm8k", train_files=[str(good)], val_holdout_rows=1))
    return c


@pytest.mark.parametrize("case", ROW_CASES, ids=[c.file for c in ROW_CASES])
def test_bad_row_strict_error_or_counted_drop(case: RowCase, ctx: RunContext) -> None:
    store = ctx.store()
    before = Committed.of(store, "r", "preprocess")
    where = rf"{BAD / case.file}, line 4: field '{case.field}': {case.detail}.* \[{case.reason}\]$"
    with pytest.raises(DataError, match=where):
        preprocess.fn(ctx, _data(case.file, strict=True))
    before.intact(store, "r")
    # the default policy: the row is dropped and counted under its reason, the three good rows kept
    lenient = ctx.model_copy(update={"run_id": "lenient"})
    m = store.read_manifest(preprocess.fn(lenient, _data(case.file, strict=False)))
    train = json.loads(store.read_bytes(m, "report.json"))["splits"]["train"]
    assert (train["read"], train["kept"], train["dropped"][case.reason]) == (4, 3, 1)
    assert train["examples"][0] == {
        "reason": case.reason,
        "where": str(BAD / case.file),
        "line": 4,
        "field": case.field,
        "detail": train["examples"][0]["detail"],
    }


def test_bom_and_crlf_rows_are_kept(tmp_path: Path) -> None:
    # The good lines of a corpus file, saved as a Windows tool would: a UTF-8 BOM and CRLF ends.
    good = (BAD / "missing_field.jsonl").read_text().splitlines()[:3]
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(line + "\r\n" for line in good).encode())
    c = RunContext(run_id="bom", store_url=str(tmp_path / "store"))
    data = DataConfig(source="gsm8k", train_files=[str(path)], strict=True, val_holdout_rows=0)
    m = c.store().read_manifest(preprocess.fn(c, data))
    train = json.loads(c.store().read_bytes(m, "report.json"))["splits"]["train"]
    assert (train["read"], train["kept"]) == (3, 3)


def test_empty_dataset(ctx: RunContext) -> None:
    with pytest.raises(DataError, match=r"^preprocess: no usable training rows from source 'gsm8k' \(read 0"):
        preprocess.fn(ctx, _data("empty.jsonl", strict=False).model_copy(update={"val_holdout_rows": 0}))
    Committed.of(ctx.store(), "r", "preprocess").intact(ctx.store(), "r")


def test_enormous_prompt_is_named_by_row(ctx: RunContext) -> None:
    store = ctx.store()
    data = _data("enormous_prompt.jsonl", strict=True).model_copy(update={"val_holdout_rows": 0})
    pre = preprocess.fn(ctx.model_copy(update={"run_id": "huge"}), data)  # a long prompt is valid data
    before = Committed.of(store, "r", "preprocess")
    huge = ctx.model_copy(update={"run_id": "huge"})
    with pytest.raises(DataError, match=r"row 4, prompt: .*tokens.*data\.max_prompt_length|row 4, prompt"):
        template_pack.fn(huge, data, ModelConfig(vocab_size=300), pre)
    assert store.committed("huge", "template_pack") is None
    before.intact(store, "r")


# ------------------------------------------------------------------------------------------------
# Rewards: unknown data_source, misbehaving functions, wrong-schema rollouts


def _rollouts(data_source: str) -> pa.Table:
    rows = [
        {
            "iteration": 0, "group_id": g, "sample_index": s, "prompt_index": g,
            "data_source": data_source, "ground_truth": "18", "prompt_text": "What is 9 + 9?",
            "prompt_ids": [1, 2], "response_ids": [3, 4], "response_text": "#### 18",
            "logprobs": [-0.5, -0.5], "finish_reason": "stop", "prompt_length": 2, "response_length": 2,
            "policy_version": 0,
        }
        for g in range(2) for s in range(2)
    ]  # fmt: skip
    return pa.Table.from_pylist(rows, schema=get_schema("rollouts"))


def _fn(name: str, **kw: Any) -> RewardConfig:
    return RewardConfig(scorers=["function"], function=f"tests.data.bad.bad_rewards:{name}", **kw)


REWARD_CASES: list[tuple[str, str, RewardConfig, type[Exception], str]] = [
    ("unknown data_source", "made/up", RewardConfig(), DataError,
     r"^rule reward: .*'made/up'.*openai/gsm8k.*\(use a function or model scorer"),
    ("function raises", "openai/gsm8k", _fn("raises"), RewardError,
     r"^reward scorer 'function' failed on row group_id=0, sample_index=0 \(data_source 'openai/gsm8k'\): "
     r"RuntimeError: the grader's database is down$"),
    ("function hangs", "openai/gsm8k", _fn("hangs", timeout_s=0.5), RewardError,
     r"failed on row group_id=0, sample_index=0 .*timed out after 0\.5 s$"),
    ("function returns NaN", "openai/gsm8k", _fn("returns_nan"), RewardError,
     r"failed on row group_id=0, sample_index=0 .*returned nan, expected a finite number$"),
    ("function returns text", "openai/gsm8k", _fn("returns_text"), RewardError,
     r"failed on row group_id=0, sample_index=0 .*returned 'high', expected a number$"),
]  # fmt: skip


@pytest.mark.parametrize("case", REWARD_CASES, ids=[c[0] for c in REWARD_CASES])
def test_bad_reward(case: tuple[str, str, RewardConfig, type[Exception], str], tmp_path: Path) -> None:
    _, source, cfg, error, message = case
    ctx = RunContext(run_id="r", store_url=str(tmp_path))
    store = ctx.store()
    stage = store.open_stage("r", "iter-0000/rollout")
    stage.write_table("rollouts.parquet", _rollouts(source), "rollouts")
    rollout_uri = stage.commit()
    if source == "openai/gsm8k":  # a committed reward of the same iteration, from the rule scorer
        reward.fn(ctx, RewardConfig(), rollout_uri, 0, 16, sandbox=SandboxConfig())
    committed = [Committed.of(store, "r", s.stage) for s in store.list_manifests("r")]
    with pytest.raises(error, match=message):
        reward.fn(ctx, cfg, rollout_uri, 0, 16, sandbox=SandboxConfig())
    for c in committed:
        c.intact(store, "r")
    if error is RewardError:  # reward.on_error=zero: the same failures are scored 0 and counted
        m = store.read_manifest(
            reward.fn(
                ctx, cfg.model_copy(update={"on_error": "zero"}), rollout_uri, 0, 16, sandbox=SandboxConfig()
            )
        )
        assert json.loads(store.read_bytes(m, "report.json"))["errors"] == 4


def test_parquet_artifact_with_wrong_schema(tmp_path: Path) -> None:
    ctx = RunContext(run_id="r", store_url=str(tmp_path))
    store = ctx.store()
    stage = store.open_stage("r", "iter-0000/rollout")
    # committed as a "rollouts" artifact, bytes intact, but not of that schema (e.g. an old producer)
    data = (BAD / "wrong_schema_rollouts.parquet").read_bytes()
    stage._put("rollouts.parquet", data, kind="rollouts", rows=1, schema=None)
    uri = stage.commit()
    where = str(store.file_uri(store.read_manifest(uri), "rollouts.parquet"))
    with pytest.raises(
        ArtifactSchemaError, match=rf"^{re.escape(where)}: 'rollouts' artifact lacks field 'sample_index'$"
    ):
        reward.fn(ctx, RewardConfig(), uri, 0, 16, sandbox=SandboxConfig())
    assert store.committed("r", "iter-0000/reward") is None
    assert pq.read_schema(BAD / "wrong_schema_rollouts.parquet").field("response_ids").type == pa.list_(
        pa.string()
    )


# ------------------------------------------------------------------------------------------------
# Configs and models


TINY = str(Path(__file__).resolve().parent / "tiny.yaml")
CONFIG_CASES = [
    (str(BAD / "unknown_key.yaml"), [], r"^error: unknown key 'actr' \(did you mean 'actor'\?\)$"),
    (str(BAD / "bad_value.yaml"), [], r"^error: algorithm\.adv_estimator: .*'ppo2'.*'gae'"),
    (str(BAD / "negative_value.yaml"), [], r"^error: rollout\.temperature: got -0\.5, expected a value >= 0"),
    (TINY, ["actor.lr=fast"], r"^error: .*actor\.lr.*'fast'"),
    (TINY, ["actr.lr=1"], r"^error: .*'actr'.*did you mean 'actor'"),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[f"{Path(c[0]).name}{c[1]}" for c in CONFIG_CASES])
def test_bad_config_is_one_line_exit_2(case: tuple[str, list[str], str]) -> None:
    file, overrides, message = case
    result = CliRunner().invoke(app, ["config", "show", file, *overrides])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert re.search(message, lines[0]), lines[0]


MODEL_CASES: list[tuple[str, Callable[[Path], str], str]] = [
    (
        "nonexistent path",
        lambda tmp: str(tmp / "no" / "such" / "model"),
        r"^model\.path: '.*/no/such/model' is not a directory",
    ),
    (
        "corrupt safetensors",
        lambda tmp: str(BAD / "corrupt_model"),
        r"^model\.path: '.*corrupt_model' is not a loadable checkpoint: ",
    ),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_bad_model_path(case: tuple[str, Callable[[Path], str], str], tmp_path: Path) -> None:
    _, path, message = case
    with pytest.raises(ModelLoadError, match=message):
        build_policy(ModelConfig(init="pretrained", path=path(tmp_path)), tokenizer=None, seed=1)
