"""Garbled-output flags: simple, documented heuristics over a response's text, each with its
threshold and the reason shown in the browser. A response is flagged when any of them fires.

    repetition      share of repeated word 3-grams: 1 - distinct / all 3-grams of the words (split
                    at ASCII whitespace), over at least ``MIN_NGRAMS`` 3-grams, >= ``REPEAT_SHARE``
                    (a model stuck in a loop repeats a phrase: "the answer is 4 the answer is 4 ..."
                    scores ~0.9; ordinary prose and arithmetic working stay under 0.2)
    non-printable   share of control characters (C0/C1 but tab, newline, carriage return) and U+FFFD
                    (bytes that did not decode) among the characters >= ``NONPRINT_SHARE``
    length cap      the response stopped at the length cap (finish_reason "length") — not always
                    garbage, but a response cut off has no final answer; one can filter it out

Word 3-grams miss a loop inside one long "word" (no spaces, e.g. "1111111..."): character 8-grams
over responses with few words catch it (``CHAR_NGRAM``, same share threshold).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

NGRAM = 3  # words per n-gram of the repetition share
CHAR_NGRAM = 8  # characters per n-gram when the response has fewer than MIN_NGRAMS word 3-grams
MIN_NGRAMS = 10  # fewer n-grams than this: too short to call repetitive
REPEAT_SHARE = 0.5  # repeated n-gram share at or above which a response is flagged
NONPRINT_SHARE = 0.1  # share of non-printable characters at or above which a response is flagged

CHUNK_ROWS = 8192  # texts per chunk of the vectorised pass (chunks run on a thread per core)

REASON_REPETITION = "repetition"
REASON_NONPRINT = "non-printable"
REASON_LENGTH_CAP = "length cap"

_NONPRINT_CLASS = r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x{9f}\x{fffd}]"  # RE2 (pyarrow) syntax
_NONPRINT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")
_SPACE = re.compile(r"[ \t\n\r\f\v]+")


def repeated_share(items: Sequence[object], n: int) -> float | None:
    """``1 - distinct / all`` over the n-grams of ``items``; None with fewer than ``MIN_NGRAMS``."""
    total = len(items) - n + 1
    if total < MIN_NGRAMS:
        return None
    grams = {tuple(items[i : i + n]) for i in range(total)} if n > 1 else set(items)
    return 1.0 - len(grams) / total


def repetition(text: str) -> float:
    """The repeated n-gram share of ``text`` (word 3-grams, else character 8-grams), 0 when short."""
    words = [w for w in _SPACE.split(text) if w]
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


def garbled_reasons(
    texts: Sequence[str | None] | pa.Array | pa.ChunkedArray, truncated: Sequence[bool | None]
) -> list[str]:
    """:func:`garbled_reason` of each response (None counts as the empty text / not truncated),
    vectorised: the words split and counted by Arrow, the word 3-grams hashed (64-bit) and their
    repeats found by sorting, in chunks of ``CHUNK_ROWS`` texts on a thread per core; the few texts
    too short for word 3-grams go through :func:`repetition`. About 10^5 responses per second."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    arr = pc.fill_null(texts if isinstance(texts, pa.Array) else pa.array(texts, pa.string()), "")
    rows = len(arr)
    if rows == 0:
        return []
    starts = range(0, rows, CHUNK_ROWS)
    with ThreadPoolExecutor(min(len(starts), os.cpu_count() or 1)) as pool:  # Arrow, numpy free the GIL
        parts = list(pool.map(lambda i: _shares(arr.slice(i, CHUNK_ROWS)), starts))
    rep = np.concatenate([p[0] for p in parts])
    nonprint = np.concatenate([p[1] for p in parts])
    for i in np.flatnonzero(np.isnan(rep)):  # fewer than MIN_NGRAMS word 3-grams
        rep[i] = repetition(arr[int(i)].as_py())
    out = []
    for r, b, c in zip(rep.tolist(), nonprint.tolist(), truncated, strict=True):
        reasons = []
        if r >= REPEAT_SHARE:
            reasons.append(f"{REASON_REPETITION} {r:.2f}")
        if b >= NONPRINT_SHARE:
            reasons.append(f"{REASON_NONPRINT} {b:.2f}")
        if c:
            reasons.append(REASON_LENGTH_CAP)
        out.append("; ".join(reasons))
    return out


def _shares(arr: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The word repetition share (:func:`_word_repetition`) and the non-printable share of each
    text of ``arr``."""
    chars = pc.utf8_length(arr).to_numpy(zero_copy_only=False).astype(np.float64)
    bad = pc.count_substring_regex(arr, _NONPRINT_CLASS).to_numpy(zero_copy_only=False)
    return _word_repetition(arr), np.divide(bad, chars, out=np.zeros(len(arr)), where=chars > 0)


def _word_repetition(arr: pa.Array) -> np.ndarray:
    """The repeated word 3-gram share of each text of ``arr``, NaN with fewer than ``MIN_NGRAMS``.

    Each 3-gram becomes one 64-bit key: the text's row in the high ``row_bits`` bits, a hash of
    its three word ids (Arrow's dictionary of the words) in the others; the keys are sorted and a
    key equal to the one before it is a repeat. Two distinct 3-grams of one text share a key with
    probability ~ k^2 / 2^(65 - row_bits) for k 3-grams (about 3e-10 for 300 of them among
    100,000 texts), the only difference from :func:`repetition`."""
    rows = len(arr)
    words = pc.ascii_split_whitespace(arr)  # the separators of _SPACE
    enc = pc.dictionary_encode(pc.list_flatten(words))
    ids = enc.indices.to_numpy(zero_copy_only=False)
    counts = pc.list_value_length(words).to_numpy(zero_copy_only=False)
    row = np.repeat(np.arange(rows, dtype=np.uint64), counts)
    empty = pc.index(enc.dictionary, "").as_py()  # leading/trailing space: an empty "word"
    if empty >= 0:
        keep = ids != empty
        ids, row = ids[keep], row[keep]
    ids = ids.astype(np.uint64)
    row_bits = max(1, int(rows - 1).bit_length())
    with np.errstate(over="ignore"):  # 64-bit hash of (w0, w1, w2), wrapping
        key = ids[:-2] * np.uint64(0x9E3779B97F4A7C15)
        key += ids[1:-1] * np.uint64(0xC2B2AE3D27D4EB4F)
        key += ids[2:] * np.uint64(0x165667B19E3779F9)
        key ^= key >> np.uint64(31)  # splitmix64's finaliser: every bit of the key mixed into the
        key *= np.uint64(0xBF58476D1CE4E5B9)  # high ones, which the row's bits leave
        key ^= key >> np.uint64(29)
    valid = row[:-2] == row[2:]  # the three words are of one text
    start = row[:-2][valid]
    key = (key[valid] >> np.uint64(row_bits)) | (start << np.uint64(64 - row_bits))
    key.sort()
    repeats = key[1:][key[1:] == key[:-1]] >> np.uint64(64 - row_bits)
    total = np.bincount(start.astype(np.int64), minlength=rows).astype(np.float64)
    repeated = np.bincount(repeats.astype(np.int64), minlength=rows).astype(np.float64)
    share = np.divide(repeated, total, out=np.zeros(rows), where=total > 0)
    share[total < MIN_NGRAMS] = np.nan
    return share
