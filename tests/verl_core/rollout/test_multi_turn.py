"""Multi-turn rollouts with tools.

The trajectory test runs the real HF engine on a tiny Qwen2 that memorised conversations calling the
calculator (trained until a checked margin holds: tests/memorised.py, so it replays them on any CPU):
the policy-loss tokens are exactly the ids the engine returned, tool tokens have mask 0,
and the packed log-probs of the training batch built from the rollouts table equal a per-sequence
forward. The loop's budgets and error paths run on a scripted engine (no model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pytest
import torch

from stages.floor.artifacts import rollouts_table
from tests import memorised
from tests.memorised import CONVERSATIONS, Replay, memorise, replay_rows
from verl_core.data.templates import HERMES, render
from verl_core.data.tokenizer import train_tokenizer
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM
from verl_core.rollout import Completion, HFEngine, SamplingParams
from verl_core.rollout.multi_turn import (
    MultiTurnSpec,
    ToolTurnRenderer,
    multi_turn_generate,
    multi_turn_metrics,
)
from verl_core.seeding import derive_seed
from verl_core.store.schemas import conform
from verl_core.tools import load_tools
from verl_core.training.batch import RolloutBatch
from verl_core.training.ppo_kernels import response_log_probs


class Recorder:
    """Wraps an engine and keeps every generate call's prompts and completions."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[list[list[int]], list[Completion]]] = []
        self.keys: list[Any] = []  # each call's prompt_keys

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_keys: Any = None
    ) -> list[Completion]:
        out = self.engine.generate(prompts, params, prompt_keys=prompt_keys)
        self.keys.append(prompt_keys)
        self.calls.append(([list(p) for p in prompts], out))
        return out


@pytest.fixture(scope="module")
def overfit() -> tuple[Any, torch.nn.Module, list[Replay]]:
    """A tokenizer, a tiny Qwen2 that has memorised CONVERSATIONS with a checked margin (greedy
    decoding replays them), and the rollouts that replay them."""
    texts = [render(HERMES, c, add_generation_prompt=False) for c in CONVERSATIONS]
    tok = train_tokenizer(texts * 20, 300)
    spec = ScratchSpec("qwen2", 64, 2, 4, 2, 128, 256)
    config = scratch_config(spec, len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    replay = replay_rows(tok, CONVERSATIONS)
    return tok, memorise(init_causal_lm(config, seed=0), replay), replay


def test_trajectory_policy_tokens_are_the_sampled_tokens(
    overfit: tuple[Any, torch.nn.Module, list[Replay]],
) -> None:
    tok, model, replay = overfit
    engine = Recorder(HFEngine(model, tok))
    prompts = [
        tok.encode(render(HERMES, c[:1], add_generation_prompt=True), add_special_tokens=False)
        for c in CONVERSATIONS
    ]
    renderer = ToolTurnRenderer(HERMES)
    spec = MultiTurnSpec(
        max_turns=3, max_tool_calls=2, max_tokens_per_turn=64, max_response_tokens=128, tool_workers=1
    )
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=64)
    out = multi_turn_generate(engine, tok, prompts, params, load_tools(["calculator"]), spec, renderer)

    # the model replayed its conversations (the fixture checked a margin at every token it samples):
    # two called the calculator, whose results were rendered as tool turns, and answered with them
    assert [(t.completion.prompt_ids, t.completion.response_ids, t.loss_mask) for t in out] == replay
    assert [[t.role for t in tr.turns] for tr in out] == [["assistant", "tool", "assistant"]] * 2 + [
        ["assistant"]
    ]
    assert [[c.result for c in tr.turns[1].calls] for tr in out[:2]] == [["408"], ["4368"]]  # 12*34, 56*78
    assert [t.completion.response_text for t in out] == ["408", "4368", "7"]
    # one generate call per turn, turn 2 only for the two samples still going
    assert [len(p) for p, _ in engine.calls] == [3, 2]

    # policy tokens = the engine's ids, turn by turn; tool tokens (mask 0) = the rendered tool turn
    first, second = engine.calls[0][1], engine.calls[1][1]
    returned = {0: [first[0], second[0]], 1: [first[1], second[1]], 2: [first[2]]}
    for s, tr in enumerate(out):
        ids, mask, logprobs = tr.completion.response_ids, tr.loss_mask, tr.completion.logprobs
        assert [t for seg in tr.turns for t in seg.ids] == ids
        assert [t for t, m in zip(ids, mask, strict=True) if m == 1] == [
            t for c in returned[s] for t in c.response_ids
        ]
        assert [lp for lp, m in zip(logprobs, mask, strict=True) if m == 1] == [
            lp for c in returned[s] for lp in c.logprobs
        ]
        for seg in tr.turns:
            if seg.role == "tool":
                assert seg.ids == tok.encode(renderer(["408" if s == 0 else "4368"], turn_closed=False))
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
        # turn 2's prompt was prompt + everything so far, as ids (nothing decoded and re-encoded)
        if s < 2:
            assert engine.calls[1][0][s] == prompts[s] + ids[: len(tr.turns[0].ids) + len(tr.turns[1].ids)]
    assert [tr.loss_mask.count(0) for tr in out][2] == 0 and out[0].loss_mask.count(0) > 0

    # through the rollouts table into the training batch: the mask survives, and packed log-probs
    # of the policy tokens equal a per-sequence forward (and the engine's behaviour log-probs)
    prompt_rows = pa.table(
        {
            "index": [0, 1, 2],
            "data_source": ["t"] * 3,
            "ground_truth": ["408", "4368", "7"],
            "prompt_text": ["p"] * 3,
        }
    )
    table = conform(
        rollouts_table([t.completion for t in out], prompt_rows, 0, 0, trajectories=out), "rollouts", "test"
    )
    assert table.column("response_length").to_pylist() == [sum(t.loss_mask) for t in out]
    rewards = pa.table({"score": pa.array([1.0, 1.0, 1.0], pa.float32())})
    batch = RolloutBatch.from_tables(table, rewards)
    assert batch.loss_mask is not None
    packed = batch.micro(range(3))
    for s, tr in enumerate(out):
        n = len(tr.loss_mask)
        assert packed.response_mask[s, :n].tolist() == [float(m) for m in tr.loss_mask]
        assert packed.response_mask[s, n:].sum() == 0
    packed_logp, _ = response_log_probs(PackedCausalLM(model), packed)
    for s, tr in enumerate(out):
        p, r = tr.completion.prompt_ids, tr.completion.response_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0]  # (P+R, V)
        reference = torch.log_softmax(logits.float(), -1)[len(p) - 1 : -1].gather(
            -1, torch.tensor(r)[:, None]
        )[:, 0]
        m = torch.tensor(tr.loss_mask, dtype=torch.float32)
        torch.testing.assert_close(packed_logp[s, : len(r)], reference * m, atol=1e-4, rtol=0)
        torch.testing.assert_close(
            packed_logp[s, : len(r)], torch.tensor(tr.completion.logprobs), atol=1e-4, rtol=0
        )


def test_memorising_fails_loudly_when_its_margin_is_not_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    # one step from a random init cannot reach the margin: the fixture stops, naming what it reached
    texts = [render(HERMES, c, add_generation_prompt=False) for c in CONVERSATIONS]
    tok = train_tokenizer(texts, 300)
    config = scratch_config(
        ScratchSpec("qwen2", 32, 1, 2, 1, 64, 256), len(tok), eos_token_id=tok.eos_token_id, pad_token_id=0
    )
    monkeypatch.setattr(memorised, "MAX_STEPS", 1)
    with pytest.raises(AssertionError, match=r"after 1 Adam steps the smallest replay margin is -?[\d.]+"):
        memorise(init_causal_lm(config, seed=0), replay_rows(tok, CONVERSATIONS))


# -- the loop's budgets and error paths, on a scripted engine -----------------------------------------


class Scripted:
    """A fake engine: turn k of every sample says ``script[k]`` (cut after ``</tool_call>`` and at
    max_new_tokens like a real engine); ids are the text's tokens, log-probs -0.5 each."""

    def __init__(self, tok: Any, script: list[str]) -> None:
        self.tok, self.script, self.turn = tok, script, 0
        self.sizes: list[int] = []

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, prompt_keys: Any = None
    ) -> list[Completion]:
        text = self.script[min(self.turn, len(self.script) - 1)]
        self.turn += 1
        self.sizes.append(len(prompts) * params.n)
        stop = next((text.index(s) + len(s) for s in params.stop if s in text), None)
        text = text if stop is None else text[:stop]
        ids = self.tok.encode(text, add_special_tokens=False)
        finish = "stop" if len(ids) <= params.max_new_tokens else "length"  # stop string or "eos"
        ids = ids[: params.max_new_tokens]
        text = self.tok.decode(ids)
        return [
            Completion(i, j, list(p), ids, text, [-0.5] * len(ids), finish)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)
            for j in range(params.n)
        ]


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok() -> Any:
    return train_tokenizer(
        [render(HERMES, c, add_generation_prompt=False) for c in CONVERSATIONS] + [CALL], 300
    )


def run(tok: Any, script: list[str], **spec: int) -> tuple[Scripted, list[Any]]:
    engine = Scripted(tok, script)
    full = {
        "max_turns": 4,
        "max_tool_calls": 4,
        "max_tokens_per_turn": 64,
        "max_response_tokens": 256,
        "tool_workers": 1,
        **spec,
    }
    out = multi_turn_generate(
        engine, tok, [[1, 2]], SamplingParams(n=2, max_new_tokens=64), load_tools(["calculator"]),
        MultiTurnSpec(**full), ToolTurnRenderer(HERMES),
    )  # fmt: skip
    return engine, out


def test_split_prompts_with_their_keys_sample_what_one_call_samples(
    overfit: tuple[Any, torch.nn.Module, list[Replay]],
) -> None:
    # sampled (T = 1, 2 per prompt): every turn of a sample is keyed by (prompt key, sample), so the
    # prompts split over two calls (other active sets at turn 2) give the same trajectories. The
    # memorised model mostly replays at T = 1 (it calls the tool, so turn 2 runs): the keys each turn
    # receives are checked too
    tok, model, _ = overfit
    prompts = [
        tok.encode(render(HERMES, c[:1], add_generation_prompt=True), add_special_tokens=False)
        for c in CONVERSATIONS
    ]
    spec = MultiTurnSpec(
        max_turns=3, max_tool_calls=2, max_tokens_per_turn=64, max_response_tokens=128, tool_workers=1
    )
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=64, seed=5)
    tools, renderer = load_tools(["calculator"]), ToolTurnRenderer(HERMES)

    def run(engine: Any, ps: list[list[int]], keys: list[int] | None) -> list[Any]:
        return multi_turn_generate(engine, tok, ps, params, tools, spec, renderer, prompt_keys=keys)

    def ids(out: list[Any]) -> list[list[int]]:
        return [t.completion.response_ids for t in out]

    engine = HFEngine(model, tok)
    whole = run(engine, prompts, None)  # (prompt, sample) order: 0.0 0.1 1.0 1.1 2.0 2.1
    split = Recorder(HFEngine(model, tok, max_batch_size=1))
    first = run(split, [prompts[0], prompts[2]], [0, 2])
    second = run(engine, [prompts[1]], [1])
    assert ids(first) == ids(whole[0:2] + whole[4:6]) and ids(second) == ids(whole[2:4])
    # turn 1: the prompts' keys; turn k > 1: each sample still going, keyed by (prompt, sample). When
    # they replay, prompt 0's two samples call the tool and prompt 2's answer at once: [[0, 2], row(0, j)]
    keyed = [(0, 0), (0, 1), (2, 0), (2, 1)]  # the split call's samples: (prompt key, sample index)
    turns = [sum(t.role == "assistant" for t in tr.turns) for tr in whole[0:2] + whole[4:6]]
    assert max(turns[:2]) > 1, "no sample of prompt 0 called the tool at T = 1: turn 2 not exercised"
    later = [
        [derive_seed("multi_turn_row", p, j) for (p, j), n in zip(keyed, turns, strict=True) if n >= k]
        for k in range(2, spec.max_turns + 1)
    ]
    assert split.keys == [[0, 2], *(keys for keys in later if keys)]


def test_malformed_call_is_answered_with_an_error_and_counted(tok: Any) -> None:
    engine, out = run(tok, ["<tool_call>\n{not json}\n</tool_call>", "42"])
    assert engine.sizes == [2, 2]  # n=2 samples in turn 1, both go on in turn 2
    calls = out[0].turns[1].calls
    assert calls[0].error is not None and calls[0].result.startswith("Error: the tool call is not valid JSON")
    assert "<tool_response>\nError: the tool call is not valid JSON" in out[0].turns[1].text
    assert out[0].completion.response_text == "42" and out[0].completion.finish_reason == "stop"
    assert multi_turn_metrics(out)["multi_turn/tool_errors_mean"] == 1.0


def test_max_tool_calls_then_max_turns(tok: Any) -> None:
    _, out = run(tok, [CALL], max_turns=3, max_tool_calls=1)
    results = [c.result for t in out[0].turns for c in t.calls]
    assert results == ["42", "Error: tool-call limit (1) reached; answer without tools"]
    # the third turn calls again: max_turns is reached, no tool runs, the response ends there
    assert [t.role for t in out[0].turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert out[0].completion.finish_reason == "length"
    assert out[0].turns[-1].role == "assistant"  # a response always ends with model tokens


def test_token_budgets_cover_model_and_tool_tokens(tok: Any) -> None:
    call_tokens = len(tok.encode(CALL))
    tool_tokens = len(tok.encode(ToolTurnRenderer(HERMES)(["42"], turn_closed=False)))
    # room for the call and its tool turn, then 3 tokens of answer
    _, out = run(tok, [CALL, "the answer is 42"], max_response_tokens=call_tokens + tool_tokens + 3)
    assert len(out[0].completion.response_ids) == call_tokens + tool_tokens + 3
    assert out[0].completion.finish_reason == "length" and sum(out[0].loss_mask) == call_tokens + 3
    # no room for one more model token after the tool turn: the tool turn is not appended
    _, out = run(tok, [CALL, "42"], max_response_tokens=call_tokens + tool_tokens)
    assert [t.role for t in out[0].turns] == ["assistant"] and out[0].completion.finish_reason == "length"
    # per-turn budget: the call is cut, so it is not a call
    _, out = run(tok, [CALL], max_tokens_per_turn=5)
    assert out[0].completion.response_ids == tok.encode(CALL)[:5] and len(out[0].turns) == 1
