"""browse.garbled's heuristics on hand-made strings, each on both sides of its threshold."""

from __future__ import annotations

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
