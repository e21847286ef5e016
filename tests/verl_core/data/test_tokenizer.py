"""Padding a trained tokenizer to a real model's vocabulary (``train_tokenizer(pad_to=...)``): the
length, the trained part's encoding unchanged, padded ids decode, files round-trip with the same ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl_core.data.tokenizer import (
    load_tokenizer_from_bytes,
    load_tokenizer_from_files,
    save_tokenizer_files,
    train_tokenizer,
    unused_token,
)
from verl_core.files import write_files

CORPUS = [
    "Natalia sold 48/2 = 24 clips in May. How many clips did she sell altogether?",
    "37 + 48 = 85\n85 - 25 = 60\n#### 60",
] * 20
# texts that spell a padded token: they must still encode as the unpadded tokenizer does
SAMPLES = [
    "<|im_start|>user\nNatalia sold 1,234 clips<|im_end|>\n",
    "<unused 300> <unused 1023>  tabs\t and\n\nnewlines",
    unused_token(1000),
]
PAD_TO = 1024


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    return train_tokenizer(CORPUS, 300), train_tokenizer(CORPUS, 300, pad_to=PAD_TO)


def _ids(tok: Any) -> list[list[int]]:
    return [tok.encode(s, add_special_tokens=False) for s in SAMPLES]


def test_padded_length_and_unchanged_encoding(pair: tuple[Any, Any]) -> None:
    plain, padded = pair
    assert len(padded) == PAD_TO and len(plain) < PAD_TO
    assert _ids(padded) == _ids(plain)
    # the trained ids keep their tokens; the new ones follow them
    assert {t: i for t, i in padded.get_vocab().items() if i < len(plain)} == plain.get_vocab()
    assert padded.convert_ids_to_tokens([len(plain), PAD_TO - 1]) == [
        unused_token(len(plain)),
        unused_token(PAD_TO - 1),
    ]


def test_padded_ids_decode(pair: tuple[Any, Any]) -> None:
    _, padded = pair
    ids = padded.encode("#### 60", add_special_tokens=False)
    # a sampled padded id between ordinary ones decodes to its spelling, the others as before
    assert padded.decode([*ids, PAD_TO - 1, *ids]) == f"#### 60<unused {PAD_TO - 1}>#### 60"


def test_pad_to_at_or_below_the_trained_size_adds_nothing(pair: tuple[Any, Any]) -> None:
    plain, _ = pair
    same = train_tokenizer(CORPUS, 300, pad_to=len(plain))
    assert same.get_vocab() == plain.get_vocab()


def test_padded_files_round_trip(pair: tuple[Any, Any], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    plain, padded = pair
    files = save_tokenizer_files(padded)
    reloaded = load_tokenizer_from_bytes(files)
    assert len(reloaded) == PAD_TO and _ids(reloaded) == _ids(plain)
    assert reloaded.convert_ids_to_tokens([PAD_TO - 1]) == [unused_token(PAD_TO - 1)]
    # an export's directory (config model_type qwen2) loads as Qwen2Tokenizer: the same ids
    d = write_files(files, tmp_path / "tok")
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": PAD_TO}))
    auto = AutoTokenizer.from_pretrained(str(d))
    assert len(auto) == PAD_TO and _ids(auto) == _ids(plain)
    assert _ids(load_tokenizer_from_files(d)) == _ids(plain)
