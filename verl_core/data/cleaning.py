"""Raw rows → verl's prompt schema and SFT rows, with every dropped row counted by reason.

A prompt row, exactly as verl's ``examples/data_preprocess/gsm8k.py`` writes it::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": question + " " + instruction}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, "answer": <raw solution>, "question": question}}

and its SFT row: the same ``prompt`` and the reference solution as ``response`` (GSM8K calculator
annotations ``<<48/2=24>>`` removed). A raw row already in verl's schema (``prompt`` messages and
``reward_model``) is kept as it is.

Bad rows (undecodable, missing/empty/wrong-type fields, no extractable ground truth, duplicates) are
dropped and counted in a :class:`CleaningReport`; in strict mode the first one raises
:class:`~verl_core.errors.DataError` naming the file, the 1-based line and the field.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from verl_core.errors import DataError
from verl_core.seeding import derive_seed

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
GSM8K_ANSWER_REGEX = r"#### (\-?[0-9\.\,]+)"
_CALCULATOR = re.compile(r"<<[^<>]*>>")

# Reasons a row is dropped (the keys of CleaningReport.dropped).
UNDECODABLE = "undecodable"
MISSING_FIELD = "missing_field"
EMPTY_FIELD = "empty_field"
WRONG_TYPE = "wrong_type"
NO_GROUND_TRUTH = "no_ground_truth"
DUPLICATE = "duplicate"
REASONS = (UNDECODABLE, MISSING_FIELD, EMPTY_FIELD, WRONG_TYPE, NO_GROUND_TRUTH, DUPLICATE)


@dataclass(frozen=True)
class RawRow:
    """One raw row: ``data`` (None when the line could not be decoded, see ``problem``), and where it
    came from: ``where`` (file path or ``hf:id[split]``), ``line`` (1-based), ``unit`` ("line"/"row")."""

    where: str
    line: int
    data: Mapping[str, Any] | None
    unit: str = "line"
    problem: str | None = None

    def location(self) -> str:
        return f"{self.where}, {self.unit} {self.line}"


@dataclass(frozen=True)
class FieldMapping:
    """How a raw row maps to verl's schema.

    ``prompt_key`` (text) or ``messages_key`` (chat messages) gives the prompt; ``instruction`` is
    appended to the last user message after a space; ``answer_key`` the reference answer/solution;
    ``ground_truth_regex`` (group 1, else the whole match) extracts the ground truth from it (None:
    the stripped answer), or ``ground_truth_key`` names a field that holds it (for data whose
    reference solution may be wrong while the ground truth is exact); ``strip_commas`` removes
    thousands separators from the ground truth; ``turns_key`` names a field holding the
    demonstration's earlier assistant/tool messages (multi-turn SFT: they go into the SFT row's
    prompt before the answer, never into the RL prompt)."""

    data_source: str
    prompt_key: str = "question"
    messages_key: str | None = None
    answer_key: str = "answer"
    ground_truth_regex: str | None = None
    ground_truth_key: str | None = None
    strip_commas: bool = False
    ability: str = "math"
    instruction: str = ""
    turns_key: str | None = None


def gsm8k_mapping(
    data_source: str = "openai/gsm8k", ground_truth_regex: str = GSM8K_ANSWER_REGEX
) -> FieldMapping:
    """verl's GSM8K mapping: question + instruction, ground truth after ``#### `` without commas."""
    return FieldMapping(
        data_source=data_source,
        ground_truth_regex=ground_truth_regex,
        strip_commas=True,
        instruction=GSM8K_INSTRUCTION,
    )


class BadRow(Exception):
    """Raised inside cleaning for one row; caught and counted (or re-raised as DataError if strict)."""

    def __init__(self, reason: str, field: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.field, self.detail = reason, field, detail


@dataclass
class CleaningReport:
    """Rows read, kept and dropped (by reason), with the first few examples of each reason."""

    strict: bool = False
    read: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    examples: list[dict[str, Any]] = field(default_factory=list)
    max_examples_per_reason: int = 3

    def drop(self, row: RawRow, bad: BadRow) -> None:
        """Count ``row`` as dropped, or raise :class:`DataError` in strict mode."""
        if self.strict:
            raise DataError(f"{row.location()}: field {bad.field!r}: {bad.detail} [{bad.reason}]")
        self.dropped[bad.reason] += 1
        if self.dropped[bad.reason] <= self.max_examples_per_reason:
            self.examples.append(
                {
                    "reason": bad.reason,
                    "where": row.where,
                    row.unit: row.line,
                    "field": bad.field,
                    "detail": bad.detail,
                }
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "read": self.read,
            "kept": self.kept,
            "dropped": {r: self.dropped.get(r, 0) for r in REASONS},
            "dropped_total": sum(self.dropped.values()),
            "examples": self.examples,
        }


class CleanSplit(NamedTuple):
    """Rows of one split: ``prompts`` in the "prompts" schema and, aligned with them, the reference
    ``responses`` ("" where the row has none: it gets no SFT row) and the demonstrations' earlier
    ``turns`` (assistant/tool messages before the response; empty for single-turn rows)."""

    prompts: list[dict[str, Any]]
    responses: list[str]
    turns: list[list[dict[str, str]]]

    def sft_rows(self) -> list[dict[str, Any]]:
        """Rows in the "sft" schema: prompt + reference response, for rows that have one."""
        return [
            {
                "data_source": p["data_source"],
                "prompt": [*p["prompt"], *t],
                "response": r,
                "index": p["extra_info"]["index"],
            }
            for p, r, t in zip(self.prompts, self.responses, self.turns, strict=True)
            if r
        ]

    def subset(self, positions: Iterable[int]) -> CleanSplit:
        chosen = list(positions)
        return CleanSplit(
            [self.prompts[i] for i in chosen],
            [self.responses[i] for i in chosen],
            [self.turns[i] for i in chosen],
        )


def clean_rows(
    rows: Iterable[RawRow],
    mapping: FieldMapping,
    *,
    split: str,
    report: CleaningReport,
    exclude_prompts: frozenset[str] = frozenset(),
) -> CleanSplit:
    """Normalise ``rows`` into verl rows, dropping (and counting in ``report``) the bad ones.

    ``split`` is written to ``extra_info.split`` (rows already in verl's schema keep theirs);
    ``extra_info.index`` is the 0-based position of the row in its source (rows in verl's schema
    keep theirs);
    ``exclude_prompts``: prompt keys (see :func:`prompt_key`) that count as duplicates, e.g. the
    training prompts when cleaning the held-out split."""
    regex = re.compile(mapping.ground_truth_regex) if mapping.ground_truth_regex else None
    seen: set[str] = set(exclude_prompts)
    out = CleanSplit([], [], [])
    for ordinal, row in enumerate(rows):
        report.read += 1
        try:
            if row.data is None:
                raise BadRow(UNDECODABLE, "<line>", row.problem or "undecodable")
            if _is_verl_row(row.data, mapping):
                prompt_row, response = _verl_row(row.data, ordinal, split, mapping)
            else:
                prompt_row, response = _mapped_row(row.data, ordinal, split, mapping, regex)
            turns = _demo_turns(row.data, mapping)
            key = prompt_key(prompt_row["prompt"])
            if key in seen:
                where = "the training split" if key in exclude_prompts else "an earlier row"
                raise BadRow(DUPLICATE, mapping.messages_key or "prompt", f"same prompt as {where}")
        except BadRow as bad:
            report.drop(row, bad)
            continue
        seen.add(key)
        report.kept += 1
        out.prompts.append(prompt_row)
        out.responses.append(response)
        out.turns.append(turns)
    return out


def prompt_key(messages: list[dict[str, str]]) -> str:
    """Identity of a prompt for de-duplication: its messages as canonical JSON."""
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


def strip_calculator_annotations(solution: str) -> str:
    """``"48/2 = <<48/2=24>>24"`` → ``"48/2 = 24"`` (GSM8K's calculator annotations removed)."""
    return _CALCULATOR.sub("", solution)


def hold_out(split: CleanSplit, n: int, seed: int) -> tuple[CleanSplit, CleanSplit]:
    """Move ``n`` seeded-random rows of ``split`` into a held-out split: (rest, held out).

    Raises DataError when fewer than ``n + 1`` rows are available."""
    total = len(split.prompts)
    if n == 0:
        return split, CleanSplit([], [], [])
    if total <= n:
        raise DataError(
            f"data.val_holdout_rows: cannot hold out {n} rows from a training set of {total} rows; "
            "lower it or give data.val_files"
        )
    chosen = set(random.Random(derive_seed("holdout", seed)).sample(range(total), n))
    rest = split.subset(i for i in range(total) if i not in chosen)
    return rest, split.subset(sorted(chosen))


def take(split: CleanSplit, n: int) -> CleanSplit:
    """The first ``n`` rows (0: all)."""
    if n == 0 or n >= len(split.prompts):
        return split
    return split.subset(range(n))


# --------------------------------------------------------------------------------------------------
# One row


def _is_verl_row(data: Mapping[str, Any], mapping: FieldMapping) -> bool:
    return mapping.messages_key is None and "reward_model" in data and isinstance(data.get("prompt"), list)


def _verl_row(
    data: Mapping[str, Any], position: int, split: str, mapping: FieldMapping
) -> tuple[dict[str, Any], str]:
    """A row already in verl's schema: validated and kept as is (missing extra_info filled in)."""
    messages = _messages(data["prompt"], "prompt")
    data_source = _text(data, "data_source", required=False) or mapping.data_source
    ability = _text(data, "ability", required=False) or mapping.ability
    reward = data["reward_model"]
    if not isinstance(reward, Mapping):
        raise BadRow(WRONG_TYPE, "reward_model", f"expected a mapping, got {_kind(reward)}")
    ground_truth = _text(reward, "ground_truth", field_name="reward_model.ground_truth")
    style = _text(reward, "style", required=False, field_name="reward_model.style") or "rule"
    extra = data.get("extra_info") or {}
    if not isinstance(extra, Mapping):
        raise BadRow(WRONG_TYPE, "extra_info", f"expected a mapping, got {_kind(extra)}")
    index = extra.get("index")
    extra_info = {
        "split": split if extra.get("split") is None else extra["split"],
        "index": position if index is None else int(index),
        "answer": extra.get("answer"),
        "question": extra.get("question"),
    }
    row = {
        "data_source": data_source,
        "prompt": messages,
        "ability": ability,
        "reward_model": {"style": style, "ground_truth": ground_truth},
        "extra_info": extra_info,
    }
    answer = extra_info["answer"]
    response = strip_calculator_annotations(answer) if isinstance(answer, str) else ""
    return row, response.strip()


def _mapped_row(
    data: Mapping[str, Any], position: int, split: str, mapping: FieldMapping, regex: re.Pattern[str] | None
) -> tuple[dict[str, Any], str]:
    if mapping.messages_key is not None:
        if mapping.messages_key not in data or data[mapping.messages_key] is None:
            raise BadRow(MISSING_FIELD, mapping.messages_key, "missing")
        messages = _messages(data[mapping.messages_key], mapping.messages_key)
        users = [m["content"] for m in messages if m["role"] == "user"]
        question = users[-1] if users else messages[-1]["content"]
    else:
        question = _text(data, mapping.prompt_key)
        messages = [{"role": "user", "content": question}]
    if mapping.instruction:
        last = messages[-1]
        content = f"{last['content']} {mapping.instruction}"
        messages = [*messages[:-1], {"role": last["role"], "content": content}]
    answer = _text(data, mapping.answer_key, allow_number=True)
    if mapping.ground_truth_key is not None:
        truth = _text(data, mapping.ground_truth_key, allow_number=True)
        ground_truth = _ground_truth(truth, replace(mapping, answer_key=mapping.ground_truth_key), None)
    else:
        ground_truth = _ground_truth(answer, mapping, regex)
    row = {
        "data_source": mapping.data_source,
        "prompt": messages,
        "ability": mapping.ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": position, "answer": answer, "question": question},
    }
    return row, strip_calculator_annotations(answer).strip()


def _demo_turns(data: Mapping[str, Any], mapping: FieldMapping) -> list[dict[str, str]]:
    """The demonstration's earlier turns (``mapping.turns_key``): assistant/tool messages."""
    if mapping.turns_key is None or not data.get(mapping.turns_key):
        return []
    turns = _messages(data[mapping.turns_key], mapping.turns_key)
    roles = {m["role"] for m in turns}
    if not roles <= {"assistant", "tool"}:
        got = sorted(roles)
        raise BadRow(WRONG_TYPE, mapping.turns_key, f"expected assistant/tool turns, got roles {got}")
    return turns


def _ground_truth(answer: str, mapping: FieldMapping, regex: re.Pattern[str] | None) -> str:
    if regex is None:
        truth = answer.strip()
    else:
        match = regex.search(answer)
        if match is None:
            raise BadRow(NO_GROUND_TRUTH, mapping.answer_key, f"no match for {regex.pattern!r}")
        truth = match.group(1) if regex.groups else match.group(0)
    if mapping.strip_commas:
        truth = truth.replace(",", "")
    if not truth.strip():
        raise BadRow(NO_GROUND_TRUTH, mapping.answer_key, "the extracted ground truth is empty")
    return truth


def _text(
    data: Mapping[str, Any],
    key: str,
    *,
    required: bool = True,
    allow_number: bool = False,
    field_name: str | None = None,
) -> str:
    name = field_name or key
    value = data.get(key)
    if value is None:
        if required:
            raise BadRow(MISSING_FIELD, name, "missing")
        return ""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if allow_number and is_number and math.isfinite(value):
        value = str(value)
    if not isinstance(value, str):
        raise BadRow(WRONG_TYPE, name, f"expected a string, got {_kind(value)}")
    if required and not value.strip():
        raise BadRow(EMPTY_FIELD, name, "empty")
    return value


def _kind(value: Any) -> str:
    """How a value is named in a row error: non-finite floats by what they are (NaN is what pandas
    writes for an empty cell), everything else by its type."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN (an empty cell?)" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return type(value).__name__


def _messages(value: Any, name: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise BadRow(WRONG_TYPE, name, f"expected a list of chat messages, got {_kind(value)}")
    if not value:
        raise BadRow(EMPTY_FIELD, name, "no messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            got = _kind(m)
            raise BadRow(WRONG_TYPE, f"{name}[{i}]", f"expected a {{role, content}} mapping, got {got}")
        role = _text(m, "role", field_name=f"{name}[{i}].role")
        content = _text(m, "content", field_name=f"{name}[{i}].content")
        out.append({"role": role, "content": content})
    return out
