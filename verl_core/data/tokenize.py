"""Rendering and tokenization: RL prompt ids, SFT ids with assistant-only loss masks, length limits.

An SFT row is tokenized as two parts, like verl's SFT dataset::

    prompt_ids   = encode(render(prompt, add_generation_prompt=True))        # mask 0
    response_ids = encode(response) + end_ids                                # mask 1
                   (end_ids: the template's end-of-turn token, e.g. <|im_end|>)

so the masked tokens decode to exactly the response followed by the end-of-turn token.

Multi-turn SFT rows (tool use) carry the earlier turns in ``prompt``: ``[user, assistant, tool,
assistant, tool, ...]`` then ``response``, the final answer. The prompt part is then the messages
before the first assistant turn; everything after it is the response part, laid out as a multi-turn
rollout's response (:mod:`verl_core.rollout.multi_turn`)::

    [assistant content + end_ids][tool turn text][assistant content + end_ids] ... [response + end_ids]
     mask 1                       mask 0          mask 1                           mask 1

so the SFT loss trains the model's turns (tool calls included) and never the tool results. Length
limits apply to each part: ``truncation`` = error (raise, naming the row) | left (keep the last
tokens) | right (keep the first tokens) | drop (skip the row); every truncation or drop is counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from verl_core.data.templates import render, resolve_template, turn_format
from verl_core.errors import DataError

TRUNCATION_MODES = ("error", "left", "right", "drop")

Messages = Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class ChatFormat:
    """A resolved chat template: its ``name`` (tokenizer/chatml/llama3/plain/hermes), Jinja
    ``template``, the tokenizer's bos/eos text, ``end_ids``, the token ids that close an assistant
    turn, and ``tools``: OpenAI function schemas shown to the model (the template's ``tools=``;
    templates without a tool list, e.g. chatml, ignore them)."""

    name: str
    template: str
    bos_token: str
    eos_token: str
    end_ids: tuple[int, ...]
    tools: tuple[Mapping[str, Any], ...] = ()

    def render(self, messages: Messages, *, add_generation_prompt: bool) -> str:
        return render(
            self.template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=list(self.tools) or None,
        )


def chat_format(tokenizer: Any, choice: str) -> ChatFormat:
    """Resolve ``choice`` (auto|chatml|llama3|plain) against ``tokenizer`` and find its end-of-turn
    ids. Raises ValueError when a template's special tokens are not single tokens of the tokenizer."""
    name, template = resolve_template(choice, getattr(tokenizer, "chat_template", None))
    bos, eos = tokenizer.bos_token or "", tokenizer.eos_token or ""
    fmt = turn_format(template, bos_token=bos, eos_token=eos)
    if not fmt.end_text:
        raise ValueError(
            f"chat template {name!r} renders no end-of-turn text (does the tokenizer have an eos token?)"
        )
    end_ids = tuple(tokenizer.encode(fmt.end_text, add_special_tokens=False))
    if len(end_ids) != 1:
        raise ValueError(
            f"chat template {name!r} ends a turn with {fmt.end_text!r}, which is {len(end_ids)} tokens "
            "for this tokenizer, not one special token; choose another data.chat_template"
        )
    return ChatFormat(name, template, bos, eos, end_ids)


class TextEncoder:
    """``encoder(texts) -> ids``: batch encoding without added special tokens, each distinct text
    encoded once per encoder (rendered prompts recur between the RL and SFT tables)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if todo:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is not None:  # the Rust tokenizer directly: no offsets, no Python wrappers
                encoded = [e.ids for e in backend.encode_batch_fast(todo, add_special_tokens=False)]
            else:
                encoded = self.tokenizer(todo, add_special_tokens=False)["input_ids"]
            self._cache.update(zip(todo, encoded, strict=True))
        return [self._cache[t] for t in texts]


class Tokenized(NamedTuple):
    """Tokenized rows of one split: ``positions`` of the kept input rows, their ``input_ids`` and
    (SFT only) ``loss_mask`` / ``prompt_lengths``; ``counts`` of truncations and drops by
    ``{field}_{truncated|dropped}``."""

    positions: list[int]
    input_ids: list[list[int]]
    loss_mask: list[list[int]] | None
    prompt_lengths: list[int]
    texts: list[str]
    counts: Counter[str]


def fit_length(ids: list[int], max_len: int, mode: str, *, where: str) -> list[int] | None:
    """``ids`` cut to ``max_len`` tokens by ``mode``, or None to drop the row.

    left keeps the last ``max_len`` tokens, right the first; error raises DataError naming ``where``."""
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "drop":
        return None
    if mode == "error":
        raise DataError(
            f"{where}: {len(ids)} tokens, over the limit of {max_len} "
            "(raise the limit or set data.truncation to left, right or drop)"
        )
    raise ValueError(f"unknown truncation mode {mode!r}; valid: {', '.join(TRUNCATION_MODES)}")


def tokenize_prompts(
    encoder: TextEncoder,
    fmt: ChatFormat,
    prompts: Sequence[Messages],
    *,
    max_length: int,
    truncation: str,
    where: str,
) -> Tokenized:
    """RL prompts rendered with the generation prompt and tokenized (no special tokens added beyond
    the template's). ``where`` names the table in errors (``{where} row {i}``, 1-based)."""
    texts = [fmt.render(m, add_generation_prompt=True) for m in prompts]
    encoded = encoder(texts)
    out = Tokenized([], [], None, [], [], Counter())
    for i, ids in enumerate(encoded):
        fitted = fit_length(list(ids), max_length, truncation, where=f"{where} row {i + 1}, prompt")
        if _count(out.counts, "prompt", ids, fitted):
            continue
        assert fitted is not None
        out.positions.append(i)
        out.input_ids.append(fitted)
        out.prompt_lengths.append(len(fitted))
        out.texts.append(texts[i])
    return out


def tokenize_sft(
    encoder: TextEncoder,
    fmt: ChatFormat,
    prompts: Sequence[Messages],
    responses: Sequence[str],
    *,
    max_prompt_length: int,
    max_response_length: int,
    truncation: str,
    where: str,
) -> Tokenized:
    """SFT rows: prompt ids (mask 0) + response ids + end-of-turn id (mask 1), each part within its
    limit. ``input_ids[i]`` and ``loss_mask[i]`` have the same length."""
    heads = [list(m[: _first_assistant(m)]) for m in prompts]
    prompt_texts = [fmt.render(h, add_generation_prompt=True) for h in heads]
    prompt_ids = encoder(prompt_texts)
    response_ids = encoder(list(responses))
    end = list(fmt.end_ids)
    out = Tokenized([], [], [], [], [], Counter())
    assert out.loss_mask is not None
    for i, (p_ids, r_ids) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        p_fit = fit_length(list(p_ids), max_prompt_length, truncation, where=f"{where} row {i + 1}, prompt")
        if _count(out.counts, "prompt", p_ids, p_fit):
            continue
        if len(heads[i]) < len(prompts[i]):  # multi-turn: earlier model turns and tool turns first
            turns, turns_mask = _multi_turn_segments(
                encoder, fmt, prompts[i], len(heads[i]), where=f"{where} row {i + 1}"
            )
        else:
            turns, turns_mask = [], []
        r_full, m_full = [*turns, *r_ids, *end], [*turns_mask, *[1] * (len(r_ids) + len(end))]
        r_fit = fit_length(r_full, max_response_length, truncation, where=f"{where} row {i + 1}, response")
        if _count(out.counts, "response", r_full, r_fit):
            continue
        assert p_fit is not None and r_fit is not None
        m_fit = m_full[len(m_full) - len(r_fit) :] if truncation == "left" else m_full[: len(r_fit)]
        out.positions.append(i)
        out.input_ids.append(p_fit + r_fit)
        out.loss_mask.append([0] * len(p_fit) + m_fit)
        out.prompt_lengths.append(len(p_fit))
        out.texts.append(prompt_texts[i])
    return out


def _first_assistant(messages: Messages) -> int:
    return next((k for k, m in enumerate(messages) if m["role"] == "assistant"), len(messages))


def _multi_turn_segments(
    encoder: TextEncoder, fmt: ChatFormat, messages: Messages, start: int, *, where: str
) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of messages[start:] up to the final response's generation prompt: each
    assistant turn's content + end_ids (mask 1), the text between (tool / user turns and the next
    generation prompt, mask 0)."""
    end_text = turn_format(fmt.template, bos_token=fmt.bos_token, eos_token=fmt.eos_token).end_text
    ids: list[int] = []
    mask: list[int] = []
    done = fmt.render(messages[:start], add_generation_prompt=True)  # text covered so far
    for k in range(start, len(messages) + 1):
        if k == len(messages) or messages[k]["role"] == "assistant":
            context = fmt.render(messages[:k], add_generation_prompt=True)  # up to the assistant turn k
            if not context.startswith(done):
                raise DataError(
                    f"{where}: the chat template does not render turn {k} after the turns before it"
                )
            between = context[len(done) :]
            if between:
                ids += encoder([between])[0]
                mask += [0] * len(ids[len(mask) :])
            if k == len(messages):
                break
            content = messages[k]["content"]
            model = [*encoder([content])[0], *fmt.end_ids] if content else list(fmt.end_ids)
            ids += model
            mask += [1] * len(model)
            done = context + content + end_text
    return ids, mask


def _count(counts: Counter[str], field: str, ids: Sequence[int], fitted: list[int] | None) -> bool:
    """Count a drop or truncation of ``field``; True when the row is dropped."""
    if fitted is None:
        counts[f"{field}_dropped"] += 1
        return True
    if len(fitted) < len(ids):
        counts[f"{field}_truncated"] += 1
    return False


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """``{count, min, mean, p50, p95, max, total}`` of token lengths (zeros when empty)."""
    if not lengths:
        return {"count": 0, "min": 0, "mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0, "total": 0}
    a = np.asarray(lengths, dtype=np.int64)
    return {
        "count": int(a.size),
        "min": int(a.min()),
        "mean": round(float(a.mean()), 3),
        "p50": round(float(np.percentile(a, 50)), 3),
        "p95": round(float(np.percentile(a, 95)), 3),
        "max": int(a.max()),
        "total": int(a.sum()),
    }
