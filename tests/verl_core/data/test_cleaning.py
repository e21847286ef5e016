"""Adapters and cleaning: verl's GSM8K rows, bad rows counted by reason, strict mode, arithmetic."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from verl_core.config import load_config
from verl_core.data.adapters import LoadOptions, get_adapter, read_jsonl
from verl_core.data.arithmetic import (
    ArithmeticProblem,
    calculator_expression,
    generate,
    teacher_solution,
    tool_demonstration,
)
from verl_core.data.cleaning import (
    CleaningReport,
    FieldMapping,
    clean_rows,
    gsm8k_mapping,
    hold_out,
    strip_calculator_annotations,
)
from verl_core.errors import DataError
from verl_core.tools.calculator import calculate
from verl_core.tools.parsing import parse_tool_calls

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
NATALIA_Q = "Natalia sold clips to 48 of her friends in April. How many?"
NATALIA_A = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"


def _write_lines(path: Path, lines: list[bytes]) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_gsm8k_row_matches_verl(tmp_path: Path) -> None:
    line = json.dumps({"question": NATALIA_Q, "answer": NATALIA_A}).encode()
    rows = read_jsonl(_write_lines(tmp_path / "one.jsonl", [line]))
    out = clean_rows(rows, gsm8k_mapping(), split="train", report=CleaningReport())
    assert out.prompts == [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": NATALIA_Q + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "1072"},  # "1,072" without the comma
            "extra_info": {"split": "train", "index": 0, "answer": NATALIA_A, "question": NATALIA_Q},
        }
    ]
    assert out.sft_rows()[0]["response"] == "Natalia sold 48/2 = 24 clips in May.\n#### 1,072"


def test_strip_calculator_annotations() -> None:
    assert strip_calculator_annotations("48/2 = <<48/2=24>>24, 3*4=<<3*4=12>>12") == "48/2 = 24, 3*4=12"


def test_every_bad_row_reason_is_counted(tmp_path: Path) -> None:
    good = {"question": "q1", "answer": "#### 5"}
    lines = [
        json.dumps(good).encode(),  # line 1: kept
        b"{not json",  # line 2: undecodable
        b"\xff\xfe bad bytes",  # line 3: undecodable (not UTF-8)
        json.dumps({"answer": "#### 1"}).encode(),  # line 4: missing question
        json.dumps({"question": "  ", "answer": "#### 1"}).encode(),  # line 5: empty question
        json.dumps({"question": ["a"], "answer": "#### 1"}).encode(),  # line 6: wrong type
        json.dumps({"question": "q2", "answer": "no marker"}).encode(),  # line 7: no ground truth
        json.dumps(good).encode(),  # line 8: duplicate of line 1
        b"",  # blank line: skipped, not a row
        json.dumps({"question": "q3", "answer": 7}).encode(),  # line 10: numeric answer, no "####"
    ]
    path = _write_lines(tmp_path / "bad.jsonl", lines)
    report = CleaningReport()
    out = clean_rows(read_jsonl(path), gsm8k_mapping(), split="train", report=report)
    assert [p["extra_info"]["question"] for p in out.prompts] == ["q1"]
    d = report.to_dict()
    assert d["read"] == 9 and d["kept"] == 1  # 10 lines minus the blank one
    assert d["dropped"] == {
        "undecodable": 2,
        "missing_field": 1,
        "empty_field": 1,
        "wrong_type": 1,
        "no_ground_truth": 2,
        "duplicate": 1,
    }
    assert {
        "reason": "missing_field",
        "where": path,
        "line": 4,
        "field": "question",
        "detail": "missing",
    } in d["examples"]


def test_strict_mode_names_file_line_and_field(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "strict.jsonl",
        [
            json.dumps({"question": "q", "answer": "#### 1"}).encode(),
            json.dumps({"question": 3, "answer": "x"}).encode(),
        ],
    )
    with pytest.raises(
        DataError, match=r"strict\.jsonl, line 2: field 'question': expected a string, got int"
    ):
        clean_rows(read_jsonl(path), gsm8k_mapping(), split="train", report=CleaningReport(strict=True))


def test_bom_and_crlf_keep_every_row(tmp_path: Path) -> None:
    # A file saved by a Windows editor: UTF-8 byte-order mark, CRLF line ends. Both rows are kept
    # (the BOM once cost the first row: "not valid JSON (Unexpected UTF-8 BOM)").
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in (1, 2)]
    path = tmp_path / "windows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\r\n" for r in rows))
    report = CleaningReport(strict=True)
    out = clean_rows(read_jsonl(str(path)), gsm8k_mapping(), split="train", report=report)
    assert [p["extra_info"]["question"] for p in out.prompts] == ["q1", "q2"]
    assert [p["reward_model"]["ground_truth"] for p in out.prompts] == ["1", "2"]


@pytest.mark.parametrize(
    ("literal", "named"),
    [("NaN", r"NaN \(an empty cell\?\)"), ("Infinity", "Infinity"), ("-Infinity", "-Infinity")],
)
def test_non_finite_values_are_named(tmp_path: Path, literal: str, named: str) -> None:
    # Python's json reads the NaN/Infinity literals (pandas writes NaN for an empty cell) as floats;
    # the error names the value, not "got float".
    path = _write_lines(tmp_path / "nan.jsonl", [f'{{"question": {literal}, "answer": "#### 1"}}'.encode()])
    with pytest.raises(
        DataError,
        match=rf"nan\.jsonl, line 1: field 'question': expected a string, got {named} \[wrong_type\]$",
    ):
        clean_rows(read_jsonl(path), gsm8k_mapping(), split="train", report=CleaningReport(strict=True))
    # A non-finite number is no ground truth either (finite numbers are accepted as answers).
    path = _write_lines(tmp_path / "nan.jsonl", [f'{{"question": "q", "answer": {literal}}}'.encode()])
    with pytest.raises(DataError, match=rf"field 'answer': expected a string, got {named} \[wrong_type\]$"):
        clean_rows(read_jsonl(path), gsm8k_mapping(), split="train", report=CleaningReport(strict=True))


def test_generic_mapping_messages_and_regex(tmp_path: Path) -> None:
    rows = [
        {
            "msgs": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
            "sol": "It is 4.",
        },
        {"msgs": [{"role": "user"}], "sol": "It is 1."},  # message without content
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    mapping = FieldMapping(
        data_source="my/chat", messages_key="msgs", answer_key="sol", ground_truth_regex=r"is (\d+)"
    )
    report = CleaningReport()
    out = clean_rows(read_jsonl(str(path)), mapping, split="train", report=report)
    assert out.prompts[0]["prompt"] == rows[0]["msgs"]
    assert out.prompts[0]["reward_model"] == {"style": "rule", "ground_truth": "4"}
    assert out.prompts[0]["extra_info"]["question"] == "2+2?"
    assert report.dropped["missing_field"] == 1


def test_verl_row_kept_as_is() -> None:
    from verl_core.data.adapters import RawRow

    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "q"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "3"},
        "extra_info": {"split": "test", "index": 41, "answer": "a <<1+2=3>>3\n#### 3", "question": "q"},
    }
    out = clean_rows(
        [RawRow("f.parquet", 1, row, unit="row")], gsm8k_mapping(), split="train", report=CleaningReport()
    )
    assert out.prompts == [row]
    assert out.responses == ["a 3\n#### 3"]


def test_hold_out_is_seeded_and_disjoint() -> None:
    from verl_core.data.adapters import RawRow

    raw = [RawRow("x", i + 1, {"question": f"q{i}", "answer": f"#### {i}"}) for i in range(10)]
    split = clean_rows(raw, gsm8k_mapping(), split="train", report=CleaningReport())
    rest, held = hold_out(split, 3, seed=1)
    assert len(rest.prompts) == 7 and len(held.prompts) == 3
    assert hold_out(split, 3, seed=1)[1] == held
    assert not {p["extra_info"]["index"] for p in rest.prompts} & {
        p["extra_info"]["index"] for p in held.prompts
    }
    with pytest.raises(DataError, match="cannot hold out 10 rows"):
        hold_out(split, 10, seed=1)


def test_arithmetic_generator() -> None:
    problems = list(generate(50, seed=3, digits=2, steps=2, ops=("+", "-")))
    assert problems == list(generate(50, seed=3, digits=2, steps=2, ops=("+", "-")))  # deterministic
    assert len({p.question for p in problems}) == 50
    for p in problems:
        lines = p.solution.split("\n")
        assert len(lines) == 3 and lines[-1] == f"#### {p.answer}"
        value = None
        for line in lines[:2]:  # each step "a op b = c" checks out and chains
            lhs, rhs = line.split(" = ")
            a, op, b = lhs.split(" ")
            assert value is None or int(a) == value
            assert 0 <= int(b) <= 99  # 2-digit operands (a subtraction never goes below zero)
            value = int(a) + int(b) if op == "+" else int(a) - int(b)
            assert value == int(rhs) and value >= 0
        assert value == p.answer
    with pytest.raises(ValueError, match="non-empty subset"):
        next(generate(1, seed=0, ops=("/",)))


def test_incomplete_teacher_stops_one_operation_short() -> None:
    exact = "37 + 48 = 85\n85 - 25 = 60\n60 + 16 = 76\n#### 76"
    p = ArithmeticProblem(question="q", solution=exact, answer=76)
    # the last line dropped, the value before it (60) reported; shown lines unchanged
    assert teacher_solution(p, 1.0, random.Random(0)) == "37 + 48 = 85\n85 - 25 = 60\n#### 60"
    assert teacher_solution(p, 0.0, random.Random(0)) == exact
    one_step = ArithmeticProblem(question="q", solution="3 + 4 = 7\n#### 7", answer=7)
    assert teacher_solution(one_step, 1.0, random.Random(0)) == "3 + 4 = 7\n#### 7"  # nothing to drop
    rng = random.Random(1)
    short = sum(teacher_solution(p, 0.3, rng) != exact for _ in range(4000))
    assert 0.27 < short / 4000 < 0.33  # about stop_early of the demonstrations


def test_terse_teacher_answers_at_once_with_the_exact_answer() -> None:
    exact = "37 + 48 = 85\n85 - 25 = 60\n#### 60"
    p = ArithmeticProblem(question="q", solution=exact, answer=60)
    assert teacher_solution(p, 0.0, random.Random(0), terse_share=1.0) == "#### 60"  # exact, no lines
    assert teacher_solution(p, 0.0, random.Random(0), terse_share=0.0) == exact
    # terse comes first: an incomplete teacher's short solution only for the worked ones
    assert teacher_solution(p, 1.0, random.Random(0), terse_share=1.0) == "#### 60"
    rng = random.Random(1)
    terse = sum(teacher_solution(p, 0.0, rng, terse_share=0.6) == "#### 60" for _ in range(4000))
    assert 0.57 < terse / 4000 < 0.63  # about terse_share of the demonstrations
    # a share of 0 draws nothing: the incomplete teacher's draws are the same with or without the option
    a, b = random.Random(5), random.Random(5)
    assert [teacher_solution(p, 0.5, a) for _ in range(50)] == [
        teacher_solution(p, 0.5, b, terse_share=0.0) for _ in range(50)
    ]


def test_arithmetic_adapter_terse_teacher_writes_both_styles_exactly_in_both_splits() -> None:
    opts = LoadOptions(
        arithmetic_train_size=400, arithmetic_val_size=50, arithmetic_digits=1, arithmetic_terse_share=0.5
    )
    src = get_adapter("arithmetic").load([], [], opts)
    assert src.val is not None
    train, test = list(src.train), list(src.val)
    terse = [r for r in train if r.data["answer"] == f"#### {r.data['ground_truth']}"]
    assert 0.4 < len(terse) / 400 < 0.6  # about arithmetic_terse_share
    # every demonstration exact; held-out ones in the same mix (the SFT validation loss sees both styles)
    assert all(r.data["answer"].endswith(f"#### {r.data['ground_truth']}") for r in train + test)
    assert 0 < sum("=" not in r.data["answer"] for r in test) < 50


def test_arithmetic_adapter_keeps_exact_ground_truth_under_an_incomplete_teacher() -> None:
    opts = LoadOptions(arithmetic_train_size=300, arithmetic_val_size=50, arithmetic_digits=1)
    exact = get_adapter("arithmetic").load([], [], opts)
    sloppy = get_adapter("arithmetic").load(
        [], [], LoadOptions(**{**opts.__dict__, "arithmetic_stop_early": 1.0})
    )
    mapping = get_adapter("arithmetic").mapping
    assert mapping is not None
    clean = {
        name: clean_rows(src.train, mapping, split="train", report=CleaningReport())
        for name, src in (("exact", exact), ("sloppy", sloppy))
    }

    # same problems, same (exact) ground truths; only the demonstrations differ
    def key(rows: list[dict]) -> list[tuple]:
        return [(r["prompt"], r["reward_model"]) for r in rows]

    assert key(clean["exact"].prompts) == key(clean["sloppy"].prompts)
    assert clean["exact"].responses != clean["sloppy"].responses
    for response in clean["sloppy"].responses:
        # two operations, one shown: the reported value is the first result, not the ground truth
        first, final = response.split("\n")
        assert final == "#### " + first.rsplit(" = ", 1)[1]
    truths = [p["reward_model"]["ground_truth"] for p in clean["sloppy"].prompts]
    assert truths == [r.rsplit("#### ", 1)[1] for r in clean["exact"].responses]
    # the held-out split is never sloppy
    val = clean_rows(sloppy.val, mapping, split="test", report=CleaningReport())
    for prompt, response in zip(val.prompts, val.responses, strict=True):
        assert response.rsplit("#### ", 1)[1] == prompt["reward_model"]["ground_truth"]


def test_registry_lists_valid_names() -> None:
    valid = "Valid names: arithmetic, gsm8k, hf, jsonl, parquet."
    with pytest.raises(DataError, match=rf"^data.source: Unknown dataset adapter 'csv'. {valid}$"):
        get_adapter("csv")


def test_gsm8k_from_hub_fails_clearly_offline() -> None:
    sources = get_adapter("gsm8k").load([], [], LoadOptions())
    with pytest.raises(DataError, match=r"cannot load HF dataset hf:openai/gsm8k/main\[train\].*OFFLINE"):
        next(iter(sources.train))


def test_missing_file_is_a_data_error() -> None:
    sources = get_adapter("jsonl").load(["/nonexistent/x.jsonl"], [], LoadOptions())
    with pytest.raises(DataError, match=r"'/nonexistent/x\.jsonl' does not exist"):
        next(iter(sources.train))


def test_tool_demonstration_calls_the_calculator_and_copies_its_result() -> None:
    p = ArithmeticProblem(question="q", solution="347 * 8 = 2776\n2776 + 512 = 3288\n#### 3288", answer=3288)
    assert calculator_expression(p) == "(347 * 8) + 512"  # left to right, as the solution computes
    turns, answer = tool_demonstration(p, 1.0, random.Random(0))
    assert [t["role"] for t in turns] == ["assistant", "tool"]
    (call,) = parse_tool_calls(turns[0]["content"])
    assert call.error is None and call.name == "calculator"
    assert call.arguments == {"expression": "(347 * 8) + 512"}
    assert calculate(call.arguments["expression"]) == turns[1]["content"] == "3288"  # 347*8=2776, +512
    assert answer == "#### 3288"
    assert tool_demonstration(p, 0.0, random.Random(0)) == ([], "#### 3288")  # answers at once


def test_arithmetic_adapter_writes_multi_turn_sft_rows_for_a_tool_using_teacher() -> None:
    opts = LoadOptions(
        arithmetic_train_size=400,
        arithmetic_val_size=50,
        arithmetic_digits=3,
        arithmetic_ops=("+", "*"),
        arithmetic_tool_share=0.5,
    )
    src = get_adapter("arithmetic").load([], [], opts)
    mapping = get_adapter("arithmetic").mapping
    assert mapping is not None
    train = clean_rows(src.train, mapping, split="train", report=CleaningReport())
    val = clean_rows(src.val, mapping, split="test", report=CleaningReport())
    with_tool = 0
    for prompt, sft in zip(train.prompts, train.sft_rows(), strict=True):
        assert [m["role"] for m in prompt["prompt"]] == ["user"]  # the RL prompt never holds the demo
        truth = prompt["reward_model"]["ground_truth"]
        assert sft["response"] == f"#### {truth}"  # exact, with or without the tool
        roles = [m["role"] for m in sft["prompt"]]
        if roles == ["user", "assistant", "tool"]:
            with_tool += 1
            assert sft["prompt"][2]["content"] == truth
            (call,) = parse_tool_calls(sft["prompt"][1]["content"])
            assert calculate(call.arguments["expression"]) == truth
        else:
            assert roles == ["user"]
    assert 0.4 < with_tool / 400 < 0.6  # about arithmetic_tool_share
    # every held-out demonstration calls the tool
    assert all([m["role"] for m in r["prompt"]] == ["user", "assistant", "tool"] for r in val.sft_rows())


def test_tool_quickstart_config_turns_on_multi_turn_and_the_tool_using_teacher() -> None:
    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "quickstart_tools.yaml")
    assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.tools == ["calculator"]
    assert 0 < cfg.data.arithmetic_tool_share < 1
