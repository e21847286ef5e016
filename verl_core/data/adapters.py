"""Dataset adapters: where raw rows come from, chosen by name from a registry.

An adapter turns a source (local JSONL/Parquet files, an HF ``datasets`` id, a generator) into
:class:`~verl_core.data.cleaning.RawRow` s (cleaning's input type), each remembering the file and
1-based line it came from, so that cleaning can name them. Undecodable lines are not raised here but
yielded with ``problem`` set: cleaning counts them (or fails on them in strict mode) like any other
bad row. Each adapter may carry a preset
:class:`~verl_core.data.cleaning.FieldMapping` (gsm8k, arithmetic); the generic ones use the
caller's mapping.

    registry name   reads                                        held-out split
    gsm8k           JSONL/Parquet files, else HF openai/gsm8k    val files / HF "test" / hold-out
    arithmetic      the seeded generator (verl_core.data.arithmetic) its own test problems
    jsonl, parquet  the files given                              val files / hold-out
    hf              an HF dataset id (train_files[0])            hf_val_split / hold-out
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from verl_core.data import arithmetic
from verl_core.data.cleaning import FieldMapping, RawRow, gsm8k_mapping
from verl_core.errors import DataError
from verl_core.registry import Registry, UnknownNameError

GSM8K_HF_ID = "openai/gsm8k"


@dataclass(frozen=True)
class LoadOptions:
    """What an adapter may need besides the files (unpacked from the config by the stage)."""

    seed: int = 1
    hf_name: str | None = None
    hf_train_split: str = "train"
    hf_val_split: str | None = "test"
    arithmetic_train_size: int = 2000
    arithmetic_val_size: int = 100
    arithmetic_digits: int = 2
    arithmetic_steps: int = 2
    arithmetic_ops: tuple[str, ...] = ("+", "-")
    arithmetic_stop_early: float = 0.0
    arithmetic_tool_share: float = 0.0
    arithmetic_terse_share: float = 0.0


class SplitSources(NamedTuple):
    """Raw rows of the training split, and of the held-out split (None: hold rows out of train)."""

    train: Iterator[RawRow]
    val: Iterator[RawRow] | None


Loader = Callable[[Sequence[str], Sequence[str], LoadOptions], SplitSources]


class Adapter(NamedTuple):
    """``load(train_files, val_files, options)`` gives the raw rows of both splits. ``mapping``: the
    preset field mapping, None for generic adapters (the caller's mapping applies).
    ``split_labels``: what ``extra_info.split`` says for (train, held-out) rows."""

    name: str
    load: Loader
    mapping: FieldMapping | None
    split_labels: tuple[str, str]


ADAPTERS: Registry[Adapter] = Registry("dataset adapter")


def register_adapter(adapter: Adapter) -> Adapter:
    """Register ``adapter`` under its name (a name registered twice is an error)."""
    return ADAPTERS.register(adapter.name)(adapter)


def get_adapter(name: str) -> Adapter:
    """The adapter registered under ``name``; the error lists the valid names."""
    try:
        return ADAPTERS.get(name)
    except UnknownNameError as e:
        raise DataError(f"data.source: {e}") from None


def adapter_names() -> list[str]:
    """The registered adapter names, sorted."""
    return list(ADAPTERS.names())


# --------------------------------------------------------------------------------------------------
# Readers


def read_jsonl(path: str) -> Iterator[RawRow]:
    """Rows of a JSON-lines file; blank lines are skipped, bad lines yielded with ``problem`` set.

    Read as ``utf-8-sig``: a byte-order mark at the start of the file (Windows editors, spreadsheet
    exports) is dropped rather than failing the first row; CRLF line ends are whitespace to JSON.
    """
    with _open(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRow(path, lineno, None, problem=f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield RawRow(path, lineno, None, problem=f"not valid JSON ({e.msg})")
                continue
            if not isinstance(obj, dict):
                yield RawRow(path, lineno, None, problem=f"a JSON {type(obj).__name__}, not an object")
                continue
            yield RawRow(path, lineno, obj)


def read_parquet(path: str) -> Iterator[RawRow]:
    """Rows of a Parquet file (``line`` = 1-based row number)."""
    if not os.path.isfile(path):
        raise DataError(f"data file {path!r} does not exist")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield RawRow(path, i, row, unit="row")


def read_files(files: Sequence[str]) -> Iterator[RawRow]:
    """Rows of every file in order, read as Parquet (``.parquet``) or JSON lines (anything else)."""
    for path in files:
        yield from read_parquet(path) if path.endswith(".parquet") else read_jsonl(path)


def read_hf(path: str, name: str | None, split: str) -> Iterator[RawRow]:
    """Rows of an HF ``datasets`` split; offline or unknown datasets become a :class:`DataError`."""
    import datasets

    where = f"hf:{path}" + (f"/{name}" if name else "") + f"[{split}]"
    try:
        ds = datasets.load_dataset(path, name, split=split)
    except Exception as e:  # datasets raises many unrelated types: connection, FileNotFound, ValueError
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = ""
        if offline:
            hint = " (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set: use local files in data.train_files)"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot load HF dataset {where}: {first}{hint}") from None
    for i, row in enumerate(ds, start=1):
        yield RawRow(where, i, row, unit="row")


def _open(path: str) -> Any:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"data file {path!r} does not exist") from None
    except OSError as e:
        raise DataError(f"data file {path!r} cannot be read ({e.strerror})") from None


# --------------------------------------------------------------------------------------------------
# Adapters


def _load_files(train_files: Sequence[str], val_files: Sequence[str], options: LoadOptions) -> SplitSources:
    if not train_files:
        raise DataError("data.train_files: no training files given for a jsonl/parquet source")
    return SplitSources(read_files(train_files), read_files(val_files) if val_files else None)


def _load_gsm8k(train_files: Sequence[str], val_files: Sequence[str], options: LoadOptions) -> SplitSources:
    # Local files when given; a train file without a val file means: hold out from train. No files:
    # the HF hub copy (config "main", splits train/test), as verl's examples/data_preprocess/gsm8k.py.
    if train_files:
        return SplitSources(read_files(train_files), read_files(val_files) if val_files else None)
    val = read_files(val_files) if val_files else read_hf(GSM8K_HF_ID, "main", "test")
    return SplitSources(read_hf(GSM8K_HF_ID, "main", "train"), val)


def _load_hf(train_files: Sequence[str], val_files: Sequence[str], options: LoadOptions) -> SplitSources:
    if not train_files:
        raise DataError("data.train_files: give the HF dataset id as the first entry for source 'hf'")
    train = read_hf(train_files[0], options.hf_name, options.hf_train_split)
    val: Iterator[RawRow] | None = None
    if val_files:
        val = read_hf(val_files[0], options.hf_name, options.hf_val_split or "test")
    elif options.hf_val_split is not None:
        val = read_hf(train_files[0], options.hf_name, options.hf_val_split)
    return SplitSources(train, val)


def _load_arithmetic(
    train_files: Sequence[str], val_files: Sequence[str], options: LoadOptions
) -> SplitSources:
    if train_files or val_files:
        raise DataError(
            "data.train_files/val_files: the arithmetic source generates its data; leave them empty"
        )
    n_train = options.arithmetic_train_size
    try:
        problems = list(
            arithmetic.generate(
                n_train + options.arithmetic_val_size,
                seed=options.seed,
                digits=options.arithmetic_digits,
                steps=options.arithmetic_steps,
                ops=options.arithmetic_ops,
            )
        )
    except ValueError as e:
        raise DataError(f"data.arithmetic_*: {e}") from None

    def rows(
        chosen: list[arithmetic.ArithmeticProblem], split: str, stop: float, tool_share: float, terse: float
    ) -> Iterator[RawRow]:
        where = f"arithmetic(seed={options.seed})[{split}]"
        teacher = random.Random(f"arithmetic-teacher:{options.seed}")  # the problems do not depend on it
        for i, p in enumerate(chosen, start=1):
            data: dict[str, Any] = {"question": p.question, "ground_truth": str(p.answer)}
            if tool_share:  # the tool-using teacher: a calculator call, or the answer at once
                data["turns"], data["answer"] = arithmetic.tool_demonstration(p, tool_share, teacher)
            else:
                data["answer"] = arithmetic.teacher_solution(p, stop, teacher, terse_share=terse)
            yield RawRow(where, i, data, unit="row")

    # the incomplete and tool-using teachers write the training demonstrations only: held-out solutions
    # are exact and complete (with a tool-using teacher, every held-out demonstration calls the
    # calculator); the terse teacher's answers are exact, so held-out solutions follow its mix of styles
    # too (the SFT validation loss then measures both styles)
    stop, share, terse = (
        options.arithmetic_stop_early, options.arithmetic_tool_share, options.arithmetic_terse_share
    )  # fmt: skip
    return SplitSources(
        rows(problems[:n_train], "train", stop, share, terse),
        rows(problems[n_train:], "test", 0.0, 1.0 if share else 0.0, terse),
    )


register_adapter(Adapter("gsm8k", _load_gsm8k, gsm8k_mapping(), ("train", "test")))
register_adapter(
    Adapter(
        "arithmetic",
        _load_arithmetic,
        # no GSM8K instruction suffix: the worked-solution format is learned in SFT, and a short
        # prompt keeps the tiny quickstart model's attention on the operands
        dataclasses.replace(
            gsm8k_mapping(data_source="synthetic/arithmetic", ground_truth_regex=r"#### (\-?[0-9]+)"),
            instruction="",
            ground_truth_key="ground_truth",  # exact even where the demonstration is not
            turns_key="turns",  # the tool-using teacher's calculator call and result
        ),
        ("train", "test"),
    )
)
register_adapter(Adapter("jsonl", _load_files, None, ("train", "val")))
register_adapter(Adapter("parquet", _load_files, None, ("train", "val")))
register_adapter(Adapter("hf", _load_hf, None, ("train", "test")))
