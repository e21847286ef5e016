"""A tiny model that replays conversations, checked by a margin rather than by a training length.

Tests that need a model to *do* something (call the calculator, then answer with its result) train it
to memorise conversations. Where a fixed number of optimizer steps ends depends on the CPU's float
rounding: on one CPU 400 Adam steps replayed "408", on an AMD EPYC the same steps answered "436668".
So :func:`memorise` trains until a criterion holds and checks it on the weights it returns:
teacher-forced on the exact rows a greedy multi-turn rollout builds (:func:`replay_rows`), at every
position the model samples, the target token's logit beats every other token's by ``MARGIN`` nats.
An engine's log-probs differ from this forward's by ~1e-6 (vLLM's CPU kernels, the HF engine's padded
batch), far below the margin, so greedy decoding replays the rows token for token on any CPU where
the fixture returned; the step cap fails loudly, naming the margin reached, where it is not.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from verl_core.data.templates import HERMES, render, turn_format
from verl_core.rollout.multi_turn import ToolTurnRenderer
from verl_core.tools.parsing import HERMES_FORMAT

MARGIN = 4.0  # nats between the target logit and the runner-up at every sampled position
MAX_STEPS = 600  # Adam steps (lr 1e-2); the tiny Qwen2s of tests/vllm and test_multi_turn took 283 and 128


def conversation(question: str, expression: str | None, answer: str) -> list[dict[str, Any]]:
    """A user question answered directly, or through one calculator call whose result is the answer."""
    if expression is None:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    call = {"function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": answer},
        {"role": "assistant", "content": answer},
    ]


CONVERSATIONS = [
    conversation("12*34?", "12*34", "408"),
    conversation("56*78?", "56*78", "4368"),
    conversation("3+4?", None, "7"),  # answered directly: done after turn 1 while the others go on
]


class Replay(NamedTuple):
    """What a greedy multi-turn rollout of one conversation returns when the model replays it: the
    templated first user turn, then model turns (``loss_mask`` 1) and tool turns (0) as the rollout
    loop appends them (each segment tokenized on its own, model turns cut at their stop)."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]


def replay_rows(tok: Any, conversations: list[list[dict[str, Any]]], template: str = HERMES) -> list[Replay]:
    """One :class:`Replay` per conversation. A model turn is the text the template renders for the
    assistant message, up to the tool-call stop string (the engine stops there and the tool turn
    closes the turn) or up to and including the end-of-turn text (the engine's stop token)."""
    end = turn_format(template).end_text
    renderer = ToolTurnRenderer(template)
    rows = []
    for conv in conversations:
        prompt = tok.encode(render(template, conv[:1], add_generation_prompt=True), add_special_tokens=False)
        ids: list[int] = []
        mask: list[int] = []
        for k in range(1, len(conv)):
            if conv[k]["role"] == "tool":
                text = renderer([conv[k]["content"]], turn_closed=False)
                seg = tok.encode(text, add_special_tokens=False)
                ids, mask = ids + seg, mask + [0] * len(seg)
                continue
            before = render(template, conv[:k], add_generation_prompt=True)
            text = render(template, conv[: k + 1], add_generation_prompt=False)
            assert text.startswith(before), "the template renders a conversation as the sum of its turns"
            text = text[len(before) :]
            stop = HERMES_FORMAT.stop if conv[k].get("tool_calls") else end
            seg = tok.encode(text[: text.index(stop) + len(stop)], add_special_tokens=False)
            ids, mask = ids + seg, mask + [1] * len(seg)
        rows.append(Replay(prompt, ids, mask))
    return rows


def _batch(rows: list[Replay]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (B, T) right-padded with 0, attention (B, T), sampled (B, T): token t was sampled by the
    model (its logit is read at t - 1)."""
    full = [r.prompt_ids + r.response_ids for r in rows]
    width = max(map(len, full))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    sampled = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, (r, seq) in enumerate(zip(rows, full, strict=True)):
        ids[b, : len(seq)], attention[b, : len(seq)] = torch.tensor(seq), 1
        sampled[b, len(r.prompt_ids) : len(seq)] = torch.tensor(r.loss_mask, dtype=torch.bool)
    return ids, attention, sampled


def _margins(logits: torch.Tensor, ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """logits (B, T, V) → (N,): target logit minus the best other logit at each sampled position."""
    pred, target = logits[:, :-1].detach(), ids[:, 1:, None]  # position t - 1 predicts token t
    best_other = pred.scatter(-1, target, float("-inf")).amax(-1)
    return (pred.gather(-1, target)[..., 0] - best_other)[sampled[:, 1:]]


def replay_margin(model: torch.nn.Module, rows: list[Replay]) -> float:
    """The smallest teacher-forced margin (nats) over every sampled position of ``rows`` (eval mode)."""
    ids, attention, sampled = _batch(rows)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    return float(_margins(logits, ids, sampled).min())


def memorise(model: torch.nn.Module, rows: list[Replay], *, seed: int = 0) -> torch.nn.Module:
    """``model`` (trained in place, returned in eval mode) after Adam steps (lr 1e-2) on the sampled
    tokens' cross-entropy until :func:`replay_margin` ≥ ``MARGIN``; AssertionError after ``MAX_STEPS``.
    Each step checks the forward it is about to step from, so training stops on weights that hold."""
    ids, attention, sampled = _batch(rows)
    targets = ids[:, 1:][sampled[:, 1:]]  # (N,) the sampled tokens
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    reached = float("-inf")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(MAX_STEPS):
            logits = model(input_ids=ids, attention_mask=attention).logits  # (B, T, V)
            reached = float(_margins(logits, ids, sampled).min())
            if reached >= MARGIN:
                break
            loss = torch.nn.functional.cross_entropy(logits[:, :-1][sampled[:, 1:]], targets)
            optim.zero_grad()
            loss.backward()
            optim.step()
    model.eval()
    reached = replay_margin(model, rows)
    assert reached >= MARGIN, (
        f"memorise: after {MAX_STEPS} Adam steps the smallest replay margin is {reached:.2f} nats, below "
        f"{MARGIN}: greedy decoding might not replay the conversations on this CPU (raise MAX_STEPS)"
    )
    return model
