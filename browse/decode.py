"""Per-token texts of a response for the token view, the way streaming detokenizers do it.

Decoding each token alone shows ``\\ufffd`` (the replacement character) for a token holding part of
a multi-byte UTF-8 character (byte-level BPE splits ``é``, ``数``, ``🙂`` into 2-4 byte tokens), and
may drop a SentencePiece token's leading space. :func:`token_texts` decodes growing windows instead:
a token's text is what ``decode(ids[start:i+1])`` adds to ``decode(ids[start:read])`` (``start``,
``read``: the window's start and the end of the text already given out, both at character
boundaries). While the window's text ends in ``\\ufffd`` the token gets ``""`` and its bytes wait
for the next token: a character spread over several tokens shows once, on its last token, and each
token keeps its own position (and values). A ``\\ufffd`` the full decode holds too (bytes that never
complete) is given out after :data:`MAX_PENDING` tokens, as the full decode shows it.

The texts concatenate to ``decode(ids)`` (checked by tests/browse/test_decode.py)."""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
MAX_PENDING = 4  # a UTF-8 character has at most 4 bytes: byte-level tokens of one character


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """One text per id of ``ids`` (``tokenizer``: a ``tokenizers.Tokenizer`` or a ``transformers``
    tokenizer, special tokens kept); ``""`` for a token whose bytes end on a later token."""

    def decode(part: list[int]) -> str:
        return str(tokenizer.decode(part, skip_special_tokens=False)) if part else ""

    out: list[str] = []
    start = read = 0  # window start, end of the text given out (token indices at character boundaries)
    for i in range(len(ids)):
        before = decode(ids[start:read])
        text = decode(ids[start : i + 1])
        waiting = i + 1 - read
        if waiting < MAX_PENDING and (text.endswith(REPLACEMENT) or not text.startswith(before)):
            out.append("")  # an incomplete character: its text goes to a later token
            continue
        out.append(text[len(before) :])
        start, read = read, i + 1
    full = decode(ids)
    given = "".join(out)
    if out and full.startswith(given) and len(full) > len(given):  # bytes still waiting at the end
        out[-1] += full[len(given) :]
    return out
