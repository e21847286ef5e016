"""Tokenizer training and reload, chat templates, SFT loss masks, length limits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl_core.data.templates import CHATML, LLAMA3, PLAIN, render, resolve_template, turn_format
from verl_core.data.tokenize import (
    TextEncoder,
    chat_format,
    fit_length,
    length_stats,
    tokenize_prompts,
    tokenize_sft,
)
from verl_core.data.tokenizer import (
    load_tokenizer_from_bytes,
    load_tokenizer_from_files,
    save_tokenizer_files,
    train_tokenizer,
)
from verl_core.errors import DataError
from verl_core.files import write_files

CORPUS = [
    "Natalia sold 48/2 = 24 clips in May. How many clips did she sell altogether?",
    "Start with 37. Add 48, then subtract 25. What is the result?",
    "37 + 48 = 85\n85 - 25 = 60\n#### 60",
    "Weng earns $12 an hour for babysitting, café ﬁne.",
] * 20 + ["user\n", "assistant\n"]
SAMPLES = [
    "<|im_start|>user\nNatalia sold 1,234 clips in café ﬁ<|im_end|>\n<|im_start|>assistant\n",
    "  spaces   and\n\nnewlines\t tabs 12345",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return train_tokenizer(CORPUS, 300, chat_template=CHATML)


def test_trained_tokenizer_specials_and_determinism(tok: Any) -> None:
    assert len(tok) <= 300
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    again = train_tokenizer(CORPUS, 300, chat_template=CHATML)
    assert again.get_vocab() == tok.get_vocab()
    ids = tok.encode(SAMPLES[0], add_special_tokens=False)
    assert ids[0] == 1 and 2 in ids  # special tokens are single tokens inside text
    assert tok.decode(ids) == SAMPLES[0].replace("ﬁ", "ﬁ")  # NFC keeps the ligature (NFKC would not)


def test_reloaded_ids_equal_trained_ids(tok: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    trained = [tok.encode(s, add_special_tokens=False) for s in SAMPLES]
    files = save_tokenizer_files(tok)
    assert "tokenizer.json" in files
    reloaded = load_tokenizer_from_bytes(files)
    assert [reloaded.encode(s, add_special_tokens=False) for s in SAMPLES] == trained
    assert reloaded.chat_template == CHATML and reloaded.padding_side == "right"
    # the transformers 5 trap: a directory whose config says qwen2 loads as Qwen2Tokenizer
    d = write_files(files, tmp_path / "tok")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 300}))
    auto = AutoTokenizer.from_pretrained(str(d))
    assert type(auto).__name__ == "Qwen2Tokenizer"
    assert [auto.encode(s, add_special_tokens=False) for s in SAMPLES] == trained
    assert [load_tokenizer_from_files(d).encode(s, add_special_tokens=False) for s in SAMPLES] == trained


def test_builtin_templates_render() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert (
        render(CHATML, msgs, add_generation_prompt=True)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(LLAMA3, msgs, add_generation_prompt=True, bos_token="<s>") == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render(PLAIN, msgs, add_generation_prompt=True) == "hi\n\n"
    assert turn_format(CHATML) == ("<|im_end|>", "\n")
    assert turn_format(PLAIN, eos_token="</s>") == ("</s>", "")
    assert resolve_template("auto", None) == ("chatml", CHATML)
    assert resolve_template("auto", "{{ x }}") == ("tokenizer", "{{ x }}")
    with pytest.raises(ValueError, match="valid: auto, chatml, llama3, plain"):
        resolve_template("vicuna", None)


def test_sft_mask_covers_exactly_response_and_end_token(tok: Any) -> None:
    fmt = chat_format(tok, "auto")
    assert fmt.end_ids == (2,)
    prompts = [[{"role": "user", "content": "Start with 37. Add 48."}]]
    out = tokenize_sft(
        TextEncoder(tok),
        fmt,
        prompts,
        ["37 + 48 = 85\n#### 85"],
        max_prompt_length=100,
        max_response_length=100,
        truncation="error",
        where="t",
    )
    ids, mask = out.input_ids[0], out.loss_mask[0]  # type: ignore[index]
    assert len(ids) == len(mask) and ids[-1] == 2 and mask[-1] == 1
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "37 + 48 = 85\n#### 85<|im_end|>"
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if not m]) == (
        "<|im_start|>user\nStart with 37. Add 48.<|im_end|>\n<|im_start|>assistant\n"
    )
    # the same as rendering the whole conversation (minus the template's trailing newline)
    full = render(
        CHATML,
        [*prompts[0], {"role": "assistant", "content": "37 + 48 = 85\n#### 85"}],
        add_generation_prompt=False,
    )
    assert tok.encode(full.removesuffix("\n"), add_special_tokens=False) == ids


def test_plain_template_ends_with_eos(tok: Any) -> None:
    fmt = chat_format(tok, "plain")
    assert fmt.end_ids == (0,)  # <|endoftext|>


def test_truncation_modes_and_counts(tok: Any) -> None:
    assert fit_length([1, 2, 3, 4], 2, "left", where="w") == [3, 4]
    assert fit_length([1, 2, 3, 4], 2, "right", where="w") == [1, 2]
    assert fit_length([1, 2, 3, 4], 2, "drop", where="w") is None
    with pytest.raises(DataError, match="w: 4 tokens, over the limit of 2"):
        fit_length([1, 2, 3, 4], 2, "error", where="w")
    fmt = chat_format(tok, "chatml")
    # "hi" renders to 19 tokens with this tiny vocabulary, the second prompt to far more than 24
    prompts = [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "Natalia sold 48 clips " * 5}],
    ]
    out = tokenize_prompts(TextEncoder(tok), fmt, prompts, max_length=24, truncation="drop", where="t")
    assert out.positions == [0] and out.counts["prompt_dropped"] == 1
    out = tokenize_prompts(TextEncoder(tok), fmt, prompts, max_length=24, truncation="left", where="t")
    assert out.positions == [0, 1] and out.counts["prompt_truncated"] == 1 and len(out.input_ids[1]) == 24
    with pytest.raises(DataError, match=r"t row 2, prompt: \d+ tokens, over the limit of 24"):
        tokenize_prompts(TextEncoder(tok), fmt, prompts, max_length=24, truncation="error", where="t")


def test_length_stats() -> None:
    # [1, 2, 3, 4, 10]: mean 20/5 = 4, median 3, p95 = 4 + 0.8 * (10 - 4) = 8.8 (linear interpolation)
    assert length_stats([1, 2, 3, 4, 10]) == {
        "count": 5,
        "min": 1,
        "mean": 4.0,
        "p50": 3.0,
        "p95": 8.8,
        "max": 10,
        "total": 20,
    }
