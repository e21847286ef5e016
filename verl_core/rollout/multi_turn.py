"""Multi-turn rollouts with tools, on any :class:`~verl_core.rollout.base.RolloutEngine`.

One response is a sequence of *segments*: model turns, exactly as the engine sampled them, and the
tool turns the loop appends between them::

    response_ids = [model turn 1][tool turn 1][model turn 2] ... [model turn K]
    loss_mask    = [1 ... 1     ][0 ... 0    ][1 ... 1     ] ... [1 ... 1     ]
    logprobs     = [engine's    ][0 ... 0    ][engine's    ] ... [engine's    ]

The model's own tokens are never decoded and re-encoded: their ids are concatenated as returned by
``engine.generate``; only the tool turns are tokenized (from text rendered with the chat template).
With the ``hermes`` template a tool turn after a model turn that stopped at ``</tool_call>`` is::

    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n408\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

(the closing ``<|im_end|>`` was not sampled, so it belongs to the tool turn; when the model did
sample it, the tool turn starts after it).

The loop (:func:`multi_turn_generate`), per turn k = 1, 2, ...:
1. one ``engine.generate`` call for every still-active sample (prompt ⧺ response so far, as ids),
   stopping at ``</tool_call>`` besides the engine's stops; turn 1 samples ``params.n`` per prompt
   with ``params.seed`` and the prompts' keys (the single-turn call), turn k > 1 one per sample with a
   seed derived from (seed, k) and the sample's own key ``derive_seed("multi_turn_row", prompt_key,
   sample_index)`` (so a sample's turns do not depend on which other samples are still active or on
   the rank it runs on); at most ``max_tokens_per_turn`` new tokens and what is left of
   ``max_response_tokens``;
2. a sample is done when its turn has no tool call, was cut by a token budget, or k = ``max_turns``;
3. otherwise its tool calls run (malformed calls and calls past ``max_tool_calls`` are answered with
   an error text instead), the results are rendered as a tool turn and appended unless that would
   leave no token of the response budget for the next model turn (then the sample is done).

``max_response_tokens`` counts every response token, model and tool (it is the length of the
response the trainer sees: ``data.max_response_length``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from verl_core.data.templates import render, turn_format
from verl_core.rollout.base import Completion, FinishReason, RolloutEngine, SamplingParams
from verl_core.seeding import derive_seed
from verl_core.tools.parsing import HERMES_FORMAT, ToolCall, ToolCallFormat
from verl_core.tools.registry import Tool, ToolResult, call_tool

_SENTINEL = "\x00VERL_FLOW_TURN\x00"


@dataclass(frozen=True)
class MultiTurnSpec:
    """Budgets of one multi-turn rollout (the stage builds it from ``rollout.multi_turn``, where the
    defaults live)."""

    max_turns: int  # model turns per response
    max_tool_calls: int  # tool calls run per response (more are answered with an error)
    max_tokens_per_turn: int  # new tokens of one model turn
    max_response_tokens: int  # every response token, model and tool (data.max_response_length)
    tool_workers: int  # threads running one turn's tool calls (all samples) in parallel


class ToolCallRecord(NamedTuple):
    name: str
    arguments: str  # JSON text of the arguments (the raw block when malformed)
    result: str  # what the model read
    error: str | None
    latency_s: float


class Turn(NamedTuple):
    """One segment of a response: ``role`` "assistant" (sampled; ``ids`` as the engine returned them)
    or "tool" (appended; ``calls`` are the calls it answers)."""

    role: str
    text: str
    ids: list[int]
    calls: list[ToolCallRecord]


class Trajectory(NamedTuple):
    """completion: the whole response as one :class:`Completion` (``response_ids`` every segment,
    ``logprobs`` 0 on tool tokens, ``response_text`` the *last model turn's* text: the answer the
    reward scores, ``finish_reason`` "stop" only when the model ended without calling a tool);
    loss_mask: 1 on model tokens, 0 on tool tokens; turns: the segments, in order."""

    completion: Completion
    loss_mask: list[int]
    turns: list[Turn]


@dataclass
class _State:
    prompt_ids: list[int]
    prompt_index: int
    sample_index: int
    ids: list[int]
    logprobs: list[float]
    mask: list[int]
    turns: list[Turn]
    tool_calls: int = 0
    finish: FinishReason = "length"
    last_text: str = ""
    done: bool = False


class ToolTurnRenderer:
    """The text of a tool turn under a chat template: what follows a model turn's content up to the
    next generation prompt, with the tool results as ``tool`` messages."""

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.template, self.bos, self.eos = template, bos_token, eos_token
        self.end_text = turn_format(template, bos_token=bos_token, eos_token=eos_token).end_text

    def __call__(self, results: Sequence[str], *, turn_closed: bool) -> str:
        """``turn_closed``: the model sampled its end-of-turn text already (it is not repeated)."""
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _SENTINEL},
            *({"role": "tool", "content": r} for r in results),
        ]
        full = render(
            self.template, messages, add_generation_prompt=True, bos_token=self.bos, eos_token=self.eos
        )
        text = full[full.index(_SENTINEL) + len(_SENTINEL) :]
        if turn_closed and self.end_text and text.startswith(self.end_text):
            text = text[len(self.end_text) :]
        return text


def multi_turn_generate(
    engine: RolloutEngine,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    tools: Mapping[str, Tool],
    spec: MultiTurnSpec,
    render_tool_turn: ToolTurnRenderer,
    call_format: ToolCallFormat = HERMES_FORMAT,
    prompt_keys: Sequence[int] | None = None,
) -> list[Trajectory]:
    """``params.n`` multi-turn responses per prompt (token ids), in (prompt, sample) order (see the
    module docstring); ``render_tool_turn`` renders tool results under the prompts' chat template,
    ``call_format`` finds the model's tool calls (and ends its turn after one); ``prompt_keys`` seed
    the prompts' samples (default: their indices, see :class:`~verl_core.rollout.base.RolloutEngine`)."""
    pkeys = list(range(len(prompts))) if prompt_keys is None else [int(k) for k in prompt_keys]
    stop = params.stop if call_format.stop in params.stop else (*params.stop, call_format.stop)
    base = replace(params, stop=stop)
    states: list[_State] = []
    for turn in range(1, spec.max_turns + 1):
        # 1. One generate call for every active sample
        if turn == 1:
            budget = min(spec.max_tokens_per_turn, spec.max_response_tokens)
            out = engine.generate(prompts, replace(base, max_new_tokens=budget), prompt_keys=pkeys)
            states = [_State(list(c.prompt_ids), c.prompt_index, c.sample_index, [], [], [], []) for c in out]
            active = list(range(len(states)))
        else:
            active = [i for i, s in enumerate(states) if not s.done]
            if not active:
                break
            budgets = [_turn_budget(states[i], spec) for i in active]
            seed = None if params.seed is None else derive_seed("multi_turn", params.seed, turn)
            out = engine.generate(
                [states[i].prompt_ids + states[i].ids for i in active],
                replace(base, n=1, seed=seed, max_new_tokens=max(budgets)),
                prompt_keys=[
                    derive_seed("multi_turn_row", pkeys[states[i].prompt_index], states[i].sample_index)
                    for i in active
                ],
            )
        # 2. Append each model turn; find the tool calls of the samples that go on
        pending: list[tuple[int, list[ToolCall], bool]] = []
        for i, c in zip(active, out, strict=True):
            s = states[i]
            ids, logprobs, text, finish = _cut(tokenizer, c, _turn_budget(s, spec))
            s.ids += ids
            s.logprobs += logprobs
            s.mask += [1] * len(ids)
            s.turns.append(Turn("assistant", text, list(ids), []))
            s.last_text = text
            calls = call_format.parse(text) if finish == "stop" else []
            if not calls:
                s.done, s.finish = True, finish
            elif turn == spec.max_turns or _turn_budget(s, spec) <= 0:
                s.done, s.finish = True, "length"
            else:
                raw = tokenizer.decode(ids, skip_special_tokens=False)
                closed = bool(render_tool_turn.end_text) and raw.endswith(render_tool_turn.end_text)
                pending.append((i, calls, closed))
        # 3. Run the tool calls, append the tool turns
        records = _run_calls(
            [(states[i], calls) for i, calls, _ in pending], tools, spec.max_tool_calls, spec.tool_workers
        )
        for (i, _, closed), recs in zip(pending, records, strict=True):
            s = states[i]
            text = render_tool_turn([r.result for r in recs], turn_closed=closed)
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if len(s.ids) + len(ids) >= spec.max_response_tokens:  # no room for another model turn
                s.done, s.finish = True, "length"
                continue
            s.ids += ids
            s.logprobs += [0.0] * len(ids)
            s.mask += [0] * len(ids)
            s.turns.append(Turn("tool", text, ids, recs))
    return [_trajectory(s) for s in states]


def _turn_budget(s: _State, spec: MultiTurnSpec) -> int:
    return min(spec.max_tokens_per_turn, spec.max_response_tokens - len(s.ids))


def _cut(tokenizer: Any, c: Completion, budget: int) -> tuple[list[int], list[float], str, FinishReason]:
    """The first ``budget`` sampled tokens of ``c`` (the batch's generate call may allow more)."""
    if len(c.response_ids) <= budget:
        return list(c.response_ids), list(c.logprobs), c.response_text, c.finish_reason
    ids = list(c.response_ids[:budget])
    return ids, list(c.logprobs[:budget]), tokenizer.decode(ids, skip_special_tokens=True), "length"


def _run_calls(
    jobs: Sequence[tuple[_State, list[ToolCall]]], tools: Mapping[str, Tool], max_calls: int, workers: int
) -> list[list[ToolCallRecord]]:
    """Each job's call records, in order. Malformed calls and calls past ``max_calls`` per sample are
    answered with an error text; the rest run, ``workers`` at a time."""
    planned: list[list[tuple[ToolCall, str | None]]] = []  # (call, error answered instead of running)
    for s, calls in jobs:
        plan: list[tuple[ToolCall, str | None]] = []
        for call in calls:
            if call.error is not None:
                plan.append((call, call.error))
            elif s.tool_calls >= max_calls:
                plan.append((call, f"tool-call limit ({max_calls}) reached; answer without tools"))
            else:
                s.tool_calls += 1
                plan.append((call, None))
        planned.append(plan)
    runs = [call for plan in planned for call, error in plan if error is None]

    def run(call: ToolCall) -> ToolResult:
        return call_tool(tools, call.name, call.arguments)

    if workers > 1 and len(runs) > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = iter(list(pool.map(run, runs)))
    else:
        results = iter([run(call) for call in runs])
    out = []
    for plan in planned:
        recs = []
        for call, error in plan:
            if error is not None:
                recs.append(ToolCallRecord(call.name, call.raw, f"Error: {error}", error, 0.0))
            else:
                r = next(results)
                args = json.dumps(call.arguments, ensure_ascii=False)
                recs.append(ToolCallRecord(call.name, args, r.text, r.error, r.latency_s))
        out.append(recs)
    return out


def _trajectory(s: _State) -> Trajectory:
    completion = Completion(
        prompt_index=s.prompt_index,
        sample_index=s.sample_index,
        prompt_ids=s.prompt_ids,
        response_ids=s.ids,
        response_text=s.last_text,
        logprobs=s.logprobs,
        finish_reason=s.finish,
    )
    return Trajectory(completion, s.mask, s.turns)


def multi_turn_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Means over samples: model turns, tool calls, tool errors (malformed, over the limit, failed),
    share of samples calling a tool, and tool tokens per response."""
    n = max(len(trajectories), 1)
    calls = [[c for t in tr.turns for c in t.calls] for tr in trajectories]
    return {
        "multi_turn/turns_mean": sum(sum(t.role == "assistant" for t in tr.turns) for tr in trajectories) / n,
        "multi_turn/tool_calls_mean": sum(len(c) for c in calls) / n,
        "multi_turn/tool_errors_mean": sum(sum(r.error is not None for r in c) for c in calls) / n,
        "multi_turn/tool_call_rate": sum(bool(c) for c in calls) / n,
        "multi_turn/tool_tokens_mean": sum(tr.loss_mask.count(0) for tr in trajectories) / n,
    }


def turns_to_rows(turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """``turns`` as plain dicts (the ``turns`` column of a "rollouts" table)."""
    return [{**t._asdict(), "calls": [c._asdict() for c in t.calls]} for t in turns]
