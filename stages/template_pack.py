"""Template/pack stage: prompt and SFT tables → token ids, loss masks, a tokenizer.

Reads the preprocess stage's tables and writes

    tokenizer/*                          the tokenizer files (trained here for model.init=scratch,
                                         the base model's otherwise), chat template included
    prompt_tokens/{train,val}.parquet    kind "prompt_tokens": RL prompts rendered with the
                                         generation prompt, their ids, ground truth
    sft_tokens/{train,val}.parquet       kind "sft_tokens": prompt + response ids, assistant-only mask
    report.json                          length statistics, truncations/drops

Later stages load the tokenizer with :func:`stages.floor.artifacts.load_tokenizer` from this stage's manifest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pyarrow as pa
from prefect import task

from stages.floor.artifacts import TOKENIZER_PREFIX
from stages.floor.initial_model import model_dir
from stages.floor.locations import TEMPLATE_PACK
from stages.floor.logging import stage_logger
from verl_core.config import DataConfig, ModelConfig
from verl_core.data import (
    ChatFormat,
    TextEncoder,
    Tokenized,
    chat_format,
    length_stats,
    load_pretrained_tokenizer,
    save_tokenizer_files,
    tokenize_prompts,
    tokenize_sft,
    train_tokenizer,
)
from verl_core.errors import DataError
from verl_core.runtime.run import RunContext
from verl_core.store import get_schema
from verl_core.tools import load_tools

STAGE = TEMPLATE_PACK
SPLITS = ("train", "val")


@task(name="template_pack")
def template_pack(
    ctx: RunContext, data: DataConfig, model: ModelConfig, preprocess_uri: str, tools: Sequence[str] = ()
) -> str:
    """Tokenize the run's prompts and SFT rows; returns the manifest URI.
    ``tools``: tool specs (``rollout.multi_turn.tools`` when multi-turn is on) whose schemas the
    prompts show the model, in the chat template's tool list (the hermes template's system turn)."""
    store = ctx.store()
    # 1. Skip when committed with the same inputs
    params = {**_params(data, model), **({"tools": list(tools)} if tools else {})}
    stage = store.open_stage(ctx.run_id, STAGE, params=params, inputs={"preprocess": preprocess_uri})
    log = stage_logger(__name__)
    if stage.done:
        log.info("template_pack: already committed, skipping (%s)", stage.manifest_uri)
        return stage.manifest_uri

    # 2. Read the preprocess tables
    upstream = store.read_manifest(preprocess_uri)
    prompts = {s: store.read_table(upstream, f"prompts/{s}.parquet") for s in SPLITS}
    sft = {s: store.read_table(upstream, f"sft/{s}.parquet") for s in SPLITS}

    # 3. The tokenizer: trained on the run's own training text, or the base model's
    tokenizer = _tokenizer(prompts["train"], sft["train"], data, model)

    # 4. The chat template (stored in the tokenizer so that every later stage renders the same)
    try:
        fmt = chat_format(tokenizer, data.chat_template)
    except ValueError as e:
        raise DataError(f"data.chat_template={data.chat_template!r}: {e}") from None
    tokenizer.chat_template = fmt.template
    fmt = replace(fmt, tools=tuple(t.openai_schema() for t in load_tools(tools).values()))

    # 5. Tokenize RL prompts and SFT rows within the length limits
    encoder = TextEncoder(tokenizer)
    tok_prompts = {s: _tokenize_prompts(encoder, fmt, prompts[s], data, s) for s in SPLITS}
    tok_sft = {s: _tokenize_sft(encoder, fmt, sft[s], data, s) for s in SPLITS}
    if not tok_prompts["train"].input_ids:
        raise DataError("template_pack: every training prompt was dropped by data.truncation=drop")

    # 6. Write tokenizer files, token tables and the report
    for name, blob in save_tokenizer_files(tokenizer).items():
        stage.write_bytes(TOKENIZER_PREFIX + name, blob)
    for s in SPLITS:
        stage.write_table(
            f"prompt_tokens/{s}.parquet", _prompt_table(prompts[s], tok_prompts[s]), "prompt_tokens"
        )
        stage.write_table(f"sft_tokens/{s}.parquet", _sft_table(sft[s], tok_sft[s]), "sft_tokens")
    report = _report(fmt, tokenizer, model, tok_prompts, tok_sft)
    stage.write_json("report.json", report)
    uri = stage.commit(
        summary={
            "chat_template": fmt.name,
            "vocab_size": len(tokenizer),
            "rows": {
                f"{k}_{s}": len(t[s].input_ids)
                for k, t in (("prompts", tok_prompts), ("sft", tok_sft))
                for s in SPLITS
            },
        }
    )

    # 7. Log and track the main figures
    metrics = _metrics(report)
    log.info(
        "template_pack: template %s, vocab %d, prompt tokens mean %.1f max %d, SFT tokens p95 %.0f, "
        "%d truncated / %d dropped",
        fmt.name,
        len(tokenizer),
        metrics["data/prompt_len_mean"],
        metrics["data/prompt_len_max"],
        metrics["data/sft_len_p95"],
        metrics["data/truncated_rows"],
        metrics["data/dropped_rows_length"],
    )
    ctx.tracker().log_metrics(metrics, step=0)
    return uri


def _tokenizer(prompts: pa.Table, sft: pa.Table, data: DataConfig, model: ModelConfig) -> Any:
    """A tokenizer trained on the training prompts and SFT rows (``model.init=scratch``), else the
    base model's."""
    if model.init == "scratch":
        texts = _training_texts(prompts, sft, data.tokenizer_train_rows)
        return train_tokenizer(
            texts,
            model.vocab_size,
            chat_template=None,
            model_max_length=model.max_position_embeddings,
            pad_to=model.vocab_pad_to,
        )
    assert model.path is not None  # the config's cross checks require it
    path = model_dir(model.path)  # a store URI: this process's copy (stages.floor.initial_model)
    return load_pretrained_tokenizer(path, trust_remote_code=model.trust_remote_code)


def _params(data: DataConfig, model: ModelConfig) -> dict[str, Any]:
    """The config fields this stage's output depends on."""
    data_fields = (
        "max_prompt_length",
        "max_response_length",
        "truncation",
        "chat_template",
        "tokenizer_train_rows",
    )
    model_fields = ("init", "path", "vocab_size", "max_position_embeddings", "trust_remote_code")
    padded = {"vocab_pad_to": model.vocab_pad_to} if model.vocab_pad_to is not None else {}
    return {
        "data": {k: getattr(data, k) for k in data_fields},
        "model": {**{k: getattr(model, k) for k in model_fields}, **padded},
    }


def _training_texts(prompts: pa.Table, sft: pa.Table, max_rows: int) -> list[str]:
    """Tokenizer training text: the messages of (at most ``max_rows``, evenly spaced) training
    prompts, their SFT responses and earlier model/tool turns, and the role names the chat template
    writes."""
    step = max(1, -(-prompts.num_rows // max_rows)) if max_rows else 1
    texts = [m["content"] for messages in prompts.column("prompt").to_pylist()[::step] for m in messages]
    texts += sft.column("response").to_pylist()[::step]
    # multi-turn demonstrations: the model and tool turns before the response (none for single-turn rows)
    texts += [
        m["content"]
        for messages in sft.column("prompt").to_pylist()[::step]
        for m in messages
        if m["role"] in ("assistant", "tool")
    ]
    return [*texts, "system\n", "user\n", "assistant\n"]


def _tokenize_prompts(
    encoder: TextEncoder, fmt: ChatFormat, table: pa.Table, data: DataConfig, split: str
) -> Tokenized:
    return tokenize_prompts(
        encoder,
        fmt,
        table.column("prompt").to_pylist(),
        max_length=data.max_prompt_length,
        truncation=data.truncation,
        where=f"preprocess prompts/{split}.parquet",
    )


def _tokenize_sft(
    encoder: TextEncoder, fmt: ChatFormat, table: pa.Table, data: DataConfig, split: str
) -> Tokenized:
    return tokenize_sft(
        encoder,
        fmt,
        table.column("prompt").to_pylist(),
        table.column("response").to_pylist(),
        max_prompt_length=data.max_prompt_length,
        max_response_length=data.max_response_length,
        truncation=data.truncation,
        where=f"preprocess sft/{split}.parquet",
    )


def _prompt_table(prompts: pa.Table, tok: Tokenized) -> pa.Table:
    rows = prompts.take(pa.array(tok.positions, type=pa.int64()))
    extra = rows.column("extra_info").combine_chunks()
    reward = rows.column("reward_model").combine_chunks()
    columns = {
        "index": extra.field("index"),
        "data_source": rows.column("data_source"),
        "ability": rows.column("ability"),
        "prompt": rows.column("prompt"),
        "prompt_text": pa.array(tok.texts, type=pa.string()),
        "ground_truth": reward.field("ground_truth"),
        "input_ids": pa.array(tok.input_ids, type=pa.list_(pa.int32())),
        "extra_info": extra,  # carried to the rollouts: a custom reward function gets it, as in verl
    }
    return pa.table(columns, schema=get_schema("prompt_tokens"))


def _sft_table(sft: pa.Table, tok: Tokenized) -> pa.Table:
    rows = sft.take(pa.array(tok.positions, type=pa.int64()))
    columns = {
        "index": rows.column("index"),
        "data_source": rows.column("data_source"),
        "input_ids": pa.array(tok.input_ids, type=pa.list_(pa.int32())),
        "loss_mask": pa.array(tok.loss_mask or [], type=pa.list_(pa.int8())),
        "prompt_length": pa.array(tok.prompt_lengths, type=pa.int32()),
    }
    return pa.table(columns, schema=get_schema("sft_tokens"))


def _report(
    fmt: ChatFormat,
    tokenizer: Any,
    model: ModelConfig,
    prompts: dict[str, Tokenized],
    sft: dict[str, Tokenized],
) -> dict[str, Any]:
    lengths: dict[str, Any] = {}
    counts: dict[str, dict[str, int]] = {}
    for s in SPLITS:
        lengths[f"prompt_{s}"] = length_stats([len(x) for x in prompts[s].input_ids])
        lengths[f"sft_{s}"] = length_stats([len(x) for x in sft[s].input_ids])
        lengths[f"response_{s}"] = length_stats([sum(m) for m in sft[s].loss_mask or []])
        counts[f"prompts_{s}"] = _all_counts(prompts[s].counts)
        counts[f"sft_{s}"] = _all_counts(sft[s].counts)
    return {
        "tokenizer": {
            "source": model.init,
            "vocab_size": len(tokenizer),
            "end_of_turn_ids": list(fmt.end_ids),
        },
        "chat_template": fmt.name,
        "lengths": lengths,
        "truncation": counts,
    }


def _all_counts(counts: Counter[str]) -> dict[str, int]:
    keys = ("prompt_truncated", "prompt_dropped", "response_truncated", "response_dropped")
    return {k: counts.get(k, 0) for k in keys}


def _metrics(report: dict[str, Any]) -> dict[str, float]:
    lengths = report["lengths"]
    truncated = sum(v for c in report["truncation"].values() for k, v in c.items() if k.endswith("truncated"))
    dropped = sum(v for c in report["truncation"].values() for k, v in c.items() if k.endswith("dropped"))
    return {
        "data/prompt_len_mean": lengths["prompt_train"]["mean"],
        "data/prompt_len_max": lengths["prompt_train"]["max"],
        "data/response_len_mean": lengths["response_train"]["mean"],
        "data/response_len_max": lengths["response_train"]["max"],
        "data/sft_len_p95": lengths["sft_train"]["p95"],
        "data/truncated_rows": truncated,
        "data/dropped_rows_length": dropped,
        "data/vocab_size": report["tokenizer"]["vocab_size"],
    }
