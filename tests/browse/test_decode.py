"""browse.decode.token_texts on a byte-level BPE tokenizer trained here (no hub): characters of 2-4
UTF-8 bytes split across tokens show once, on their last token, and no replacement character
appears where the full decode has none."""

from __future__ import annotations

from typing import Any

import pytest

from browse.decode import REPLACEMENT, token_texts

TEXT = "naïve café 数学 🙂"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """Byte-level BPE with the 256 byte symbols and a few merges learnt from ASCII text only: every
    non-ASCII character (ï é: 2 bytes, 数 学: 3, 🙂: 4) is split into one token per byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(["naive cafe in a cafe", "the naive answer"] * 20, trainer=trainer)
    return tok


def test_multi_byte_characters_show_once_on_their_last_token(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT).ids
    alone = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert REPLACEMENT in "".join(alone)  # one token at a time: the split characters are garbled
    assert tokenizer.decode(ids) == TEXT  # the whole response decodes cleanly
    texts = token_texts(tokenizer, ids)
    assert len(texts) == len(ids)  # one text per token: the values stay per token
    assert "".join(texts) == TEXT
    assert not any(REPLACEMENT in t for t in texts)
    # 🙂 is 4 bytes = 4 tokens: three empty texts, then the character on the fourth (the last token)
    assert texts[-4:] == ["", "", "", "🙂"]
    # 数 (3 bytes) then 学 (3 bytes): "", "", "数", "", "", "学" after the space
    assert texts[-11:-5] == ["", "", "数", "", "", "学"]
    # ASCII tokens decode as they do alone
    assert [t for t, a in zip(texts, alone, strict=True) if REPLACEMENT not in a] == [
        a for a in alone if REPLACEMENT not in a
    ]


def test_bytes_that_never_complete_show_as_the_full_decode_does(tokenizer: Any) -> None:
    """A lead byte of 🙂 followed by ASCII: the full decode holds a replacement character; it is
    given out (after at most 4 waiting tokens) and the texts still concatenate to the decode."""
    ids = tokenizer.encode(TEXT).ids
    broken = [ids[-4], *tokenizer.encode(" the naive answer").ids]
    full = tokenizer.decode(broken)
    assert REPLACEMENT in full
    texts = token_texts(tokenizer, broken)
    assert "".join(texts) == full and len(texts) == len(broken)


def test_empty_response(tokenizer: Any) -> None:
    assert token_texts(tokenizer, []) == []
