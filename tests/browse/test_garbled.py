"""browse.garbled's heuristics on hand-made strings, each on both sides of its threshold, and the
vectorised pass against the readable reference."""

from __future__ import annotations

import pytest

from browse import garbled
from browse.garbled import (
    NONPRINT_SHARE,
    REPEAT_SHARE,
    garbled_reason,
    garbled_reasons,
    nonprintable,
    repeated_share,
    repetition,
)

ARITHMETIC = "Start with 4. Add 7: 4 + 7 = 11. Then subtract 5: 11 - 5 = 6. #### 6"


def test_a_loop_is_flagged_and_ordinary_working_is_not() -> None:
    loop = "the answer is 4 " * 10  # 40 words, 38 3-grams of which 4 distinct: share 1 - 4/38 ~ 0.89
    assert repetition(loop) == 1 - 4 / 38
    assert garbled_reason(loop) == f"repetition {1 - 4 / 38:.2f}"
    assert repetition(ARITHMETIC) < REPEAT_SHARE  # 17 3-grams, all distinct: 0
    assert garbled_reason(ARITHMETIC) == ""


def test_short_texts_are_never_repetitive() -> None:
    # fewer than MIN_NGRAMS=10 3-grams and fewer than 10 character 8-grams: too short to call
    assert repeated_share(["a", "a", "a", "a", "a"], 3) is None
    assert repetition("4 4 4 4 4") == 0.0


def test_a_loop_without_spaces_is_caught_by_character_ngrams() -> None:
    # one "word": no word 3-grams; 43 character 8-grams of "1"*50, 1 distinct: share 1 - 1/43
    assert repetition("1" * 50) == 1 - 1 / 43
    assert garbled_reason("1" * 50).startswith("repetition")


def test_non_printable_share() -> None:
    # 10 characters, 2 of them control characters (BEL, U+FFFD): 0.2 >= NONPRINT_SHARE; tab and
    # newline are printable here
    text = "ab\acd\ufffdef\tg"
    assert len(text) == 10 and nonprintable(text) == 0.2
    assert garbled_reason(text) == "non-printable 0.20"
    assert nonprintable("line one\nline two\ttab") == 0.0
    assert nonprintable("x" * 19 + "\x00") == 0.05 < NONPRINT_SHARE
    assert nonprintable("") == 0.0


def test_length_cap_and_reasons_combine() -> None:
    assert garbled_reason(ARITHMETIC, truncated=True) == "length cap"
    both = "\x01\x02 the end " * 10  # repeated and 2/11 of it control characters
    assert garbled_reason(both, truncated=True) == (
        f"repetition {repetition(both):.2f}; non-printable {nonprintable(both):.2f}; length cap"
    )
    assert garbled_reasons([ARITHMETIC, None], [False, None]) == ["", ""]


def test_vectorised_reasons_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # garbled_reasons (Arrow split, hashed 3-grams sorted per chunk) against garbled_reason, text by
    # text; CHUNK_ROWS=3 puts the texts in several chunks run on threads
    monkeypatch.setattr(garbled, "CHUNK_ROWS", 3)
    texts = [
        "the answer is 4 " * 10,  # a loop with a trailing space (an empty last "word")
        "  \tleading\nspace " + "so the answer is 7\n" * 6,  # leading whitespace, newlines
        ARITHMETIC,
        "a b c " * 4 + "d e f g h i j k l m n",  # 23 words: 21 3-grams, 14 distinct: share 1/3, not flagged
        "x y z " * 5 + "q",  # 16 words: 14 3-grams, 4 distinct: share 5/7, flagged
        "1" * 50,  # no word 3-grams: character 8-grams
        "4 4 4 4 4",  # too short for either
        "\x01\x02 the end " * 10,
        "ab\acd\ufffdef\tg",
        "héllo wörld ünïcode " * 4,  # non-ASCII words
        "",
        None,
        "one\u00a0two three four five six seven eight nine ten eleven twelve",  # NBSP is not a separator
        "a\vb\fc " * 8,  # vertical tab and form feed separate words
    ]
    truncated = [i % 3 == 0 for i in range(len(texts))]
    want = [garbled_reason(t or "", c) for t, c in zip(texts, truncated, strict=True)]
    assert garbled_reasons(texts, truncated) == want
    assert sum(bool(w) for w in want) >= 6  # both sides of the thresholds are covered
