"""Preprocess stage: raw data → verl prompt rows and SFT rows, with a report of what was dropped.

Reads the source named by ``data.source`` (gsm8k, arithmetic, jsonl, parquet, hf: see
``verl_core.data.adapters``) and writes

    prompts/train.parquet, prompts/val.parquet   kind "prompts" (verl's schema)
    sft/train.parquet, sft/val.parquet           kind "sft" (prompt + reference response)
    report.json                                  rows read / kept / dropped by reason, examples

Bad rows are dropped and counted (``data.strict``: fail on the first, naming file, line, field).
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from prefect import task

from stages.floor.locations import PREPROCESS
from stages.floor.logging import stage_logger
from verl_core.config import DataConfig
from verl_core.data import (
    CleaningReport,
    CleanSplit,
    FieldMapping,
    LoadOptions,
    clean_rows,
    get_adapter,
    hold_out,
    prompt_key,
    take,
)
from verl_core.errors import DataError
from verl_core.runtime.run import RunContext
from verl_core.store import get_schema

STAGE = PREPROCESS


@task(name="preprocess")
def preprocess(ctx: RunContext, data: DataConfig) -> str:
    """Build the prompt and SFT tables of the run from ``data``; returns the manifest URI."""
    log = stage_logger(__name__)
    store = ctx.store()
    # 1. Skip when committed with the same inputs
    stage = store.open_stage(ctx.run_id, STAGE, params=data.model_dump(mode="json"))
    if stage.done:
        log.info("preprocess: already committed, skipping (%s)", stage.manifest_uri)
        return stage.manifest_uri

    # 2. Choose the adapter and the field mapping (a preset for gsm8k/arithmetic, else the config's)
    adapter = get_adapter(data.source)
    mapping = adapter.mapping or _mapping_from_config(data)
    sources = adapter.load(data.train_files, data.val_files, _load_options(data))

    # 3. Clean both splits; held-out rows that repeat a training prompt count as duplicates
    report = {"train": CleaningReport(strict=data.strict), "val": CleaningReport(strict=data.strict)}
    train_label, val_label = adapter.split_labels
    train = clean_rows(sources.train, mapping, split=train_label, report=report["train"])
    if sources.val is not None:
        train_keys = frozenset(prompt_key(r["prompt"]) for r in train.prompts)
        val = clean_rows(
            sources.val, mapping, split=val_label, report=report["val"], exclude_prompts=train_keys
        )
    else:
        train, val = hold_out(train, data.val_holdout_rows, data.seed)

    # 4. Cap the sizes, refuse an empty result
    train, val = take(train, data.max_train_samples), take(val, data.max_val_samples)
    if not train.prompts:
        raise DataError(
            f"preprocess: no usable training rows from source {data.source!r} "
            f"(read {report['train'].read}, dropped {dict(report['train'].dropped)})"
        )
    if sources.val is not None and not val.prompts:
        raise DataError(f"preprocess: no usable held-out rows (dropped {dict(report['val'].dropped)})")

    # 5. Write the tables and the report
    for name, split in (("train", train), ("val", val)):
        stage.write_table(f"prompts/{name}.parquet", _table(split.prompts, "prompts"), kind="prompts")
        stage.write_table(f"sft/{name}.parquet", _table(split.sft_rows(), "sft"), kind="sft")
    summary = _summary(data, mapping, train, val, report)
    stage.write_json("report.json", summary)
    for name, r in report.items():
        dropped = {k: v for k, v in r.dropped.items() if v}
        log.info("preprocess %s: read %d, kept %d, dropped %s", name, r.read, r.kept, dropped or "none")
    uri = stage.commit(summary={k: summary[k] for k in ("source", "data_source", "rows", "dropped_total")})

    # 6. Metrics
    ctx.tracker().log_metrics(
        {
            "data/train_rows": len(train.prompts),
            "data/val_rows": len(val.prompts),
            "data/sft_train_rows": len(train.sft_rows()),
            "data/dropped_rows": summary["dropped_total"],
        },
        step=0,
    )
    return uri


def _mapping_from_config(data: DataConfig) -> FieldMapping:
    return FieldMapping(
        data_source=data.data_source or _default_data_source(data),
        prompt_key=data.prompt_key,
        messages_key=data.messages_key,
        answer_key=data.answer_key,
        ground_truth_regex=data.ground_truth_regex,
        ability=data.ability,
        instruction=data.instruction,
    )


def _default_data_source(data: DataConfig) -> str:
    if not data.train_files:
        return data.source
    first = data.train_files[0]
    if data.source == "hf":
        return first
    name = first.rsplit("/", 1)[-1]
    for ext in (".jsonl", ".json", ".parquet"):
        name = name.removesuffix(ext)
    return name


def _load_options(data: DataConfig) -> LoadOptions:
    return LoadOptions(
        seed=data.seed,
        hf_name=data.hf_name,
        hf_train_split=data.hf_train_split,
        hf_val_split=data.hf_val_split,
        arithmetic_train_size=data.arithmetic_train_size,
        arithmetic_val_size=data.arithmetic_val_size,
        arithmetic_digits=data.arithmetic_digits,
        arithmetic_steps=data.arithmetic_steps,
        arithmetic_ops=tuple(data.arithmetic_ops),
        arithmetic_stop_early=data.arithmetic_stop_early,
        arithmetic_tool_share=data.arithmetic_tool_share,
        arithmetic_terse_share=data.arithmetic_terse_share,
    )


def _table(rows: list[dict[str, Any]], kind: str) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=get_schema(kind))


def _summary(
    data: DataConfig,
    mapping: FieldMapping,
    train: CleanSplit,
    val: CleanSplit,
    report: dict[str, CleaningReport],
) -> dict[str, Any]:
    splits = {name: r.to_dict() for name, r in report.items()}
    return {
        "source": data.source,
        "data_source": mapping.data_source,
        "rows": {
            "train": len(train.prompts),
            "val": len(val.prompts),
            "sft_train": len(train.sft_rows()),
            "sft_val": len(val.sft_rows()),
        },
        "dropped_total": sum(s["dropped_total"] for s in splits.values()),
        "splits": splits,
    }
