"""Tokenizers: a byte-level BPE trained on the run's own text (init=scratch), files in and out.

The trained tokenizer uses the Qwen2 pre-tokenizer pipeline (NFC, Qwen's regex split, byte-level
without its own regex; single digits are separate tokens). transformers 5 loads any directory
whose ``config.json`` says ``model_type: qwen2`` as ``Qwen2Tokenizer``, which swaps in exactly this
pipeline: a plain byte-level BPE would then reload with *different ids*. Trained
this way, ids are the same whichever way the files are loaded.

Special tokens: ``<|endoftext|>`` (eos and pad, id 0), ``<|im_start|>``, ``<|im_end|>`` (chatml).

Padding (``pad_to``): a real model's vocabulary (Qwen2.5: 151,936 ids) on a small trained one, so
that the embedding and LM head have the real rows and cost. The extra ids are entries of the BPE
model's own vocabulary (``added_tokens`` would be matched against every input string, which makes
tokenization slow at 150k of them) spelled ``<unused N>`` with a plain space: the byte-level
pre-tokenizer maps every space to ``Ġ``, so no input word contains one and no merge can build one,
and encoding is unchanged. Decoding one gives its spelling back (the byte-level decoder keeps a
token whose characters are not byte symbols as its UTF-8 bytes).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from verl_core.files import read_files, write_files

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2's pre-tokenizer split pattern (tokenizer.json of Qwen/Qwen2.5-*).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    chat_template: str | None = None,
    model_max_length: int = 1024,
    min_frequency: int = 2,
    pad_to: int | None = None,
) -> Any:
    """Train a byte-level BPE on ``texts`` with at most ``vocab_size`` tokens (special tokens
    included) and wrap it as a ``transformers`` fast tokenizer (eos = pad = ``<|endoftext|>``).
    ``pad_to``: then add unused ids up to ``pad_to`` (``len(tokenizer) == pad_to``; none when the
    trained vocabulary is already that large; see the module docstring).

    Deterministic: the same texts in the same order give the same vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} is below the 256 bytes + {len(SPECIAL_TOKENS)} special tokens"
        )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if pad_to is not None and pad_to > tok.get_vocab_size():
        tok = _pad_vocabulary(tok, pad_to)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
    )
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped


def unused_token(token_id: int) -> str:
    """The spelling of padded id ``token_id``: a space inside, so no byte-level word can match it."""
    return f"<unused {token_id}>"


def _pad_vocabulary(tok: Any, pad_to: int) -> Any:
    """``tok`` (a trained BPE ``tokenizers.Tokenizer``) with ids ``len(vocab) .. pad_to - 1`` added
    to its model vocabulary as :func:`unused_token` (merges unchanged)."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(len(vocab))), "BPE ids are 0..n-1"
    vocab.update({unused_token(i): i for i in range(len(vocab), pad_to)})
    return Tokenizer.from_str(json.dumps(spec))


def save_tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files of ``tokenizer`` (``save_pretrained``) as ``{file name: bytes}``."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return read_files(tmp)


def load_tokenizer_from_files(directory: str | os.PathLike[str]) -> Any:
    """Load a tokenizer saved by :func:`save_tokenizer_files` with exactly the ids it was saved with.

    Reads ``tokenizer.json`` through ``PreTrainedTokenizerFast`` (never a model-type specific class
    that may swap the pre-tokenizer, see the module docstring); ``padding_side`` is not saved by
    transformers, so it is set to "right" here (generation code sets "left" itself)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(directory)
    if (path / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "right"
    return tok


def load_pretrained_tokenizer(path: str, *, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` for a pretrained base model (local dir or hub id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_tokenizer_from_bytes(files: Mapping[str, bytes]) -> Any:
    """:func:`load_tokenizer_from_files` for ``{file name: bytes}`` (e.g. read from a manifest)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_files(files, tmp)
        return load_tokenizer_from_files(tmp)
