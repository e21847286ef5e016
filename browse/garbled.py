"""Garbled-output flags: simple, documented heuristics over a response's text, each with its
threshold and the reason shown in the browser. A response is flagged when any of them fires.

    repetition      share of repeated word 3-grams: 1 - distinct / all 3-grams of the whitespace-split
                    words, over at least ``MIN_NGRAMS`` 3-grams, >= ``REPEAT_SHARE`` (a model stuck in a
                    loop repeats the same phrase: "the answer is 4 the answer is 4 ..." scores ~0.9;
                    ordinary prose and arithmetic working stay under 0.2)
    non-printable   share of control characters (C0/C1 but tab, newline, carriage return) and U+FFFD
                    (bytes that did not decode) among the characters >= ``NONPRINT_SHARE``
    length cap      the response stopped at the length cap (finish_reason "length") — not always
                    garbage, but a response cut off has no final answer; one can filter it out

Word 3-grams miss a loop inside one long "word" (no spaces, e.g. "1111111..."): character 8-grams
over responses with few words catch it (``CHAR_NGRAM``, same share threshold).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

NGRAM = 3  # words per n-gram of the repetition share
CHAR_NGRAM = 8  # characters per n-gram when the response has fewer than MIN_NGRAMS word 3-grams
MIN_NGRAMS = 10  # fewer n-grams than this: too short to call repetitive
REPEAT_SHARE = 0.5  # repeated n-gram share at or above which a response is flagged
NONPRINT_SHARE = 0.1  # share of non-printable characters at or above which a response is flagged

REASON_REPETITION = "repetition"
REASON_NONPRINT = "non-printable"
REASON_LENGTH_CAP = "length cap"

_NONPRINT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")


def repeated_share(items: Sequence[object], n: int) -> float | None:
    """``1 - distinct / all`` over the n-grams of ``items``; None with fewer than ``MIN_NGRAMS``."""
    total = len(items) - n + 1
    if total < MIN_NGRAMS:
        return None
    grams = {tuple(items[i : i + n]) for i in range(total)} if n > 1 else set(items)
    return 1.0 - len(grams) / total


def repetition(text: str) -> float:
    """The repeated n-gram share of ``text`` (word 3-grams, else character 8-grams), 0 when short."""
    words = text.split()
    share = repeated_share(words, NGRAM)
    if share is None:
        share = repeated_share(text, CHAR_NGRAM)
    return share or 0.0


def nonprintable(text: str) -> float:
    """The share of non-printable characters (module doc) of ``text``; 0 for an empty text."""
    return len(_NONPRINT.findall(text)) / len(text) if text else 0.0


def garbled_reason(text: str, truncated: bool = False) -> str:
    """``""`` for a response no heuristic flags, else the reasons that fired with their values,
    joined by ``"; "`` (e.g. ``"repetition 0.92; length cap"``)."""
    reasons = []
    rep = repetition(text)
    if rep >= REPEAT_SHARE:
        reasons.append(f"{REASON_REPETITION} {rep:.2f}")
    bad = nonprintable(text)
    if bad >= NONPRINT_SHARE:
        reasons.append(f"{REASON_NONPRINT} {bad:.2f}")
    if truncated:
        reasons.append(REASON_LENGTH_CAP)
    return "; ".join(reasons)


def garbled_reasons(texts: Sequence[str | None], truncated: Sequence[bool | None]) -> list[str]:
    """:func:`garbled_reason` of each response (None counts as the empty text / not truncated)."""
    return [garbled_reason(t or "", bool(c)) for t, c in zip(texts, truncated, strict=True)]
