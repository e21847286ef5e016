"""The preprocess stage through the artifact store: GSM8K sample, arithmetic, verl parquet round trip,
bad rows, strict mode, empty results, skip on rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stages.preprocess import preprocess
from verl_core.config import DataConfig
from verl_core.errors import DataError
from verl_core.runtime.run import RunContext
from verl_core.store import get_schema

REPO = Path(__file__).resolve().parents[2]
TRAIN_SAMPLE = str(REPO / "data" / "gsm8k" / "train_sample.jsonl")
TEST_SAMPLE = str(REPO / "data" / "gsm8k" / "test_sample.jsonl")


def _ctx(tmp_path: Path, run_id: str = "t") -> RunContext:
    return RunContext(run_id=run_id, store_url=str(tmp_path))


def test_gsm8k_sample(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    data = DataConfig(source="gsm8k", train_files=[TRAIN_SAMPLE], val_files=[TEST_SAMPLE])
    uri = preprocess.fn(ctx, data)
    store = ctx.store()
    m = store.read_manifest(uri)
    assert m.summary["rows"] == {"train": 200, "val": 100, "sft_train": 200, "sft_val": 100}
    train = store.read_table(m, "prompts/train.parquet").to_pylist()
    first = train[0]
    assert first["data_source"] == "openai/gsm8k"
    assert first["reward_model"] == {"style": "rule", "ground_truth": "72"}  # "#### 72" in line 1
    assert first["extra_info"]["split"] == "train" and first["extra_info"]["index"] == 0
    assert first["prompt"][0]["content"].endswith('output the final answer after "####".')
    sft = store.read_table(m, "sft/train.parquet").to_pylist()[0]
    assert sft["response"] == (
        "Natalia sold 48/2 = 24 clips in May.\n"
        "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"
    )
    val = store.read_table(m, "prompts/val.parquet").to_pylist()
    assert val[0]["extra_info"]["split"] == "test"
    report = json.loads(store.read_bytes(m, "report.json"))
    assert report["splits"]["train"]["dropped_total"] == 0
    # rerun with the same inputs: skipped, same manifest
    assert preprocess.fn(ctx, data) == uri
    assert store.read_manifest(uri).attempt == m.attempt


def test_arithmetic_default_sizes_and_holdout(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    uri = preprocess.fn(ctx, DataConfig(arithmetic_train_size=40, arithmetic_val_size=10))
    m = ctx.store().read_manifest(uri)
    assert m.summary["rows"]["train"] == 40 and m.summary["rows"]["val"] == 10
    row = ctx.store().read_table(m, "prompts/train.parquet").to_pylist()[0]
    assert row["data_source"] == "synthetic/arithmetic"
    assert row["extra_info"]["answer"].endswith("#### " + row["reward_model"]["ground_truth"])


def test_jsonl_without_val_holds_rows_out(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"q": f"what is {i}?", "a": str(i)}) for i in range(20)))
    ctx = _ctx(tmp_path)
    data = DataConfig(
        source="jsonl", train_files=[str(path)], prompt_key="q", answer_key="a", val_holdout_rows=5
    )
    m = ctx.store().read_manifest(preprocess.fn(ctx, data))
    assert m.summary["rows"]["train"] == 15 and m.summary["rows"]["val"] == 5
    assert m.summary["data_source"] == "mine"
    row = ctx.store().read_table(m, "prompts/train.parquet").to_pylist()[0]
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["answer"]


def test_verl_parquet_round_trips_unchanged(tmp_path: Path) -> None:
    # a GSM8K parquet as verl's examples/data_preprocess/gsm8k.py writes it
    lines = Path(TRAIN_SAMPLE).read_text().splitlines()
    tables = {}
    for split, chunk in (("train", lines[:30]), ("test", lines[30:40])):
        rows = []
        for i, line in enumerate(chunk):
            raw = json.loads(line)
            rows.append(
                {
                    "data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": raw["question"] + " Let's think step by step."}],
                    "ability": "math",
                    "reward_model": {
                        "style": "rule",
                        "ground_truth": raw["answer"].split("#### ")[1].replace(",", ""),
                    },
                    "extra_info": {
                        "split": split,
                        "index": i,
                        "answer": raw["answer"],
                        "question": raw["question"],
                    },
                }
            )
        tables[split] = pa.Table.from_pylist(rows, schema=get_schema("prompts"))
        pq.write_table(tables[split], tmp_path / f"{split}.parquet")
    ctx = _ctx(tmp_path)
    data = DataConfig(
        source="parquet",
        train_files=[str(tmp_path / "train.parquet")],
        val_files=[str(tmp_path / "test.parquet")],
    )
    m = ctx.store().read_manifest(preprocess.fn(ctx, data))
    assert m.summary["dropped_total"] == 0
    assert ctx.store().read_table(m, "prompts/train.parquet").equals(tables["train"])
    assert ctx.store().read_table(m, "prompts/val.parquet").equals(tables["test"])
    # and what our stage writes reads back through the parquet adapter unchanged too
    train_again = tmp_path / "again.parquet"
    pq.write_table(ctx.store().read_table(m, "prompts/train.parquet"), train_again)
    ctx2 = _ctx(tmp_path, "t2")
    data2 = DataConfig(source="parquet", train_files=[str(train_again)], val_holdout_rows=0)
    m2 = ctx2.store().read_manifest(preprocess.fn(ctx2, data2))
    assert ctx2.store().read_table(m2, "prompts/train.parquet").equals(tables["train"])


def test_bad_rows_counted_in_report(tmp_path: Path) -> None:
    good = [json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(3)]
    bad = ["{broken", json.dumps({"question": "q9"}), json.dumps({"question": "q0", "answer": "#### 0"})]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(good + bad))
    ctx = _ctx(tmp_path)
    data = DataConfig(source="gsm8k", train_files=[str(path)], val_holdout_rows=1)
    m = ctx.store().read_manifest(preprocess.fn(ctx, data))
    report = json.loads(ctx.store().read_bytes(m, "report.json"))
    assert report["splits"]["train"]["read"] == 6 and report["splits"]["train"]["kept"] == 3
    assert report["splits"]["train"]["dropped"]["undecodable"] == 1
    assert report["splits"]["train"]["dropped"]["missing_field"] == 1
    assert report["splits"]["train"]["dropped"]["duplicate"] == 1
    assert m.summary["dropped_total"] == 3


def test_strict_fails_on_first_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(
        json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + json.dumps({"question": "r", "answer": 5})
    )
    data = DataConfig(source="gsm8k", train_files=[str(path)], strict=True, val_holdout_rows=0)
    with pytest.raises(DataError, match=r"train\.jsonl, line 2: field 'answer': no match"):
        preprocess.fn(_ctx(tmp_path), data)


def test_wrong_type_field(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": {"text": "q"}, "answer": "#### 1"}))
    data = DataConfig(source="gsm8k", train_files=[str(path)], strict=True, val_holdout_rows=0)
    with pytest.raises(DataError, match=r"line 1: field 'question': expected a string, got dict"):
        preprocess.fn(_ctx(tmp_path), data)


def test_empty_result_is_a_data_error(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "q"}) + "\n\n")
    data = DataConfig(source="gsm8k", train_files=[str(path)], val_holdout_rows=0)
    with pytest.raises(DataError, match=r"no usable training rows .*missing_field"):
        preprocess.fn(_ctx(tmp_path), data)
