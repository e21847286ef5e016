"""The template/pack stage through the artifact store: tokenizer artifacts, SFT masks, prompt ids,
length limits, pretrained tokenizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stages.floor.artifacts import load_tokenizer
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from verl_core.config import DataConfig, ModelConfig
from verl_core.data.tokenizer import save_tokenizer_files, train_tokenizer
from verl_core.errors import DataError
from verl_core.files import write_files
from verl_core.runtime.run import RunContext

SMALL = {"arithmetic_train_size": 60, "arithmetic_val_size": 10}


def _run(
    tmp_path: Path, data: DataConfig, model: ModelConfig | None = None, run_id: str = "t"
) -> tuple[Any, Any]:
    ctx = RunContext(run_id=run_id, store_url=str(tmp_path))
    pre = preprocess.fn(ctx, data)
    uri = template_pack.fn(ctx, data, model or ModelConfig(), pre)
    store = ctx.store()
    return store, store.read_manifest(uri)


def test_scratch_arithmetic(tmp_path: Path) -> None:
    data = DataConfig(**SMALL)
    store, m = _run(tmp_path, data)
    tok = load_tokenizer(store, store.manifest_uri("t", "template_pack"))
    assert len(tok) <= ModelConfig().vocab_size and tok.chat_template is not None
    sft = store.read_table(m, "sft_tokens/train.parquet").to_pylist()
    assert len(sft) == 60
    sft_src = store.read_table(
        store.read_manifest(store.manifest_uri("t", "preprocess")), "sft/train.parquet"
    )
    response = sft_src.column("response")[0].as_py()
    row = sft[0]
    masked = [t for t, keep in zip(row["input_ids"], row["loss_mask"], strict=True) if keep]
    assert tok.decode(masked) == response + "<|im_end|>"  # exactly the response and the end token
    assert row["prompt_length"] == row["loss_mask"].index(1)
    prompts = store.read_table(m, "prompt_tokens/train.parquet").to_pylist()
    p = prompts[0]
    assert p["prompt_text"].endswith("<|im_start|>assistant\n")
    assert tok.encode(p["prompt_text"], add_special_tokens=False) == p["input_ids"]
    assert p["input_ids"] == row["input_ids"][: row["prompt_length"]]
    assert p["ground_truth"] and p["data_source"] == "synthetic/arithmetic" and p["index"] == 0
    report = json.loads(store.read_bytes(m, "report.json"))
    assert report["lengths"]["sft_train"]["count"] == 60
    # the stage writes the tokenizer, the token tables and the report, nothing else
    assert {f.name.split("/")[0] for f in m.files} == {
        "tokenizer",
        "prompt_tokens",
        "sft_tokens",
        "report.json",
    }
    assert m.summary["chat_template"] == "chatml"


def test_length_limits(tmp_path: Path) -> None:
    # prompts are ~50 tokens with the trained tokenizer: a limit of 20 errors, drops or truncates
    with pytest.raises(
        DataError, match=r"prompts/train\.parquet row 1, prompt: \d+ tokens, over the limit of 20"
    ):
        _run(tmp_path, DataConfig(**SMALL, max_prompt_length=20, truncation="error"), run_id="e")
    with pytest.raises(DataError, match="every training prompt was dropped"):
        _run(tmp_path, DataConfig(**SMALL, max_prompt_length=20, truncation="drop"), run_id="d")
    store, m = _run(tmp_path, DataConfig(**SMALL, max_prompt_length=20, truncation="left"), run_id="l")
    report = json.loads(store.read_bytes(m, "report.json"))
    assert report["truncation"]["prompts_train"]["prompt_truncated"] == 60
    assert report["truncation"]["sft_train"]["prompt_truncated"] == 60
    assert report["lengths"]["prompt_train"]["max"] == 20
    assert all(
        len(ids) == 20
        for ids in store.read_table(m, "prompt_tokens/train.parquet").column("input_ids").to_pylist()
    )


def test_pretrained_tokenizer_without_template_uses_named_builtin(tmp_path: Path) -> None:
    base = train_tokenizer(["Start with 12. Add 3.", "12 + 3 = 15\n#### 15"] * 10, 300)
    model_dir = write_files(save_tokenizer_files(base), tmp_path / "base")
    model = ModelConfig(init="pretrained", path=str(model_dir))
    data = DataConfig(**SMALL, chat_template="plain", max_prompt_length=256, max_response_length=128)
    store, m = _run(tmp_path / "store", data, model)
    assert m.summary["chat_template"] == "plain"
    tok = load_tokenizer(store, store.manifest_uri("t", "template_pack"))
    row = store.read_table(m, "sft_tokens/train.parquet").to_pylist()[0]
    assert row["input_ids"][-1] == tok.eos_token_id  # plain ends the assistant turn with eos


def test_tokenizer_train_rows_is_part_of_the_stage_key(tmp_path: Path) -> None:
    # data.tokenizer_train_rows changes the trained tokenizer: a rerun with another value recomputes
    ctx = RunContext(run_id="rows", store_url=str(tmp_path))
    pre = preprocess.fn(ctx, DataConfig(**SMALL))
    first = ctx.store().read_manifest(template_pack.fn(ctx, DataConfig(**SMALL), ModelConfig(), pre))
    fewer = DataConfig(**SMALL, tokenizer_train_rows=6)  # every 10th of the 60 training rows
    second = ctx.store().read_manifest(template_pack.fn(ctx, fewer, ModelConfig(), pre))
    assert first.input_key != second.input_key
