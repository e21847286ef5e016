"""VLLMEngine against the HF engine and the trainer: generation, log-probs, seeds, weight sync on
content, payload checks, sleep, multi-turn tools. One engine for the module (one engine start).
The content checks (log-probs = the trainer's, tolerance) are in checks.py."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.memorised import Replay
from verl_core.data.templates import HERMES
from verl_core.errors import ConfigError
from verl_core.rollout import HFEngine, SamplingParams
from verl_core.rollout.multi_turn import MultiTurnSpec, ToolTurnRenderer, multi_turn_generate
from verl_core.rollout.vllm import VLLMEngine, merged_state_dict
from verl_core.tools import load_tools

from .checks import TOL, assert_engine_holds, max_logprob_gap
from .conftest import tiny_qwen2


def real_update(model: torch.nn.Module, prompts: list[list[int]], lr: float = 3e-2) -> torch.nn.Module:
    """A copy of ``model`` after one Adam step on the log-likelihood of a fixed continuation."""
    new = copy.deepcopy(model).train()
    optim = torch.optim.Adam(new.parameters(), lr=lr)
    ids = torch.tensor([prompts[0] + prompts[1]])
    loss = new(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    return new.eval()


@contextmanager
def holding(engine: VLLMEngine, model: torch.nn.Module, then: torch.nn.Module) -> Iterator[None]:
    """The engine holds ``model``'s weights inside the block, ``then``'s after it. The memorising model
    is too sure of itself to sample anything but its conversations: sampling tests use a random one."""
    engine.load_weights(merged_state_dict(model).items(), 1)
    try:
        yield
    finally:
        engine.load_weights(merged_state_dict(then).items(), 0)


@pytest.fixture(scope="module")
def engine(overfit: torch.nn.Module, tok: Any) -> Iterator[VLLMEngine]:
    from .spec import engine_spec

    e = VLLMEngine(overfit, tok, engine_spec())
    yield e
    e.close()


def test_greedy_ids_and_logprobs_equal_the_hf_engine_and_the_trainer(
    engine: VLLMEngine, overfit: torch.nn.Module, tok: Any, prompt_ids: list[list[int]]
) -> None:
    params = SamplingParams(n=2, temperature=0, max_new_tokens=16)
    got = engine.generate(prompt_ids, params)
    ref = HFEngine(overfit, tok).generate(prompt_ids, params)
    assert [(c.prompt_index, c.sample_index, c.response_ids, c.finish_reason) for c in got] == [
        (c.prompt_index, c.sample_index, c.response_ids, c.finish_reason) for c in ref
    ]
    assert [c.response_text for c in got] == [c.response_text for c in ref]
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOL, rtol=0)
    assert max_logprob_gap(overfit, got, 0.0) < TOL


def test_sampled_logprobs_are_the_trainers_at_the_temperature(
    engine: VLLMEngine, overfit: torch.nn.Module, tok: Any, prompt_ids: list[list[int]]
) -> None:
    random = tiny_qwen2(tok, seed=1).eval()
    with holding(engine, random, overfit):
        for temperature in (1.0, 0.7):
            params = SamplingParams(n=4, temperature=temperature, max_new_tokens=16, seed=5)
            done = engine.generate(prompt_ids, params)
            assert len({tuple(c.response_ids) for c in done}) > 6  # really sampled
            assert max_logprob_gap(random, done, temperature) < TOL


def test_per_request_seeds_reproduce_and_split_calls_equal_one_call(
    engine: VLLMEngine, overfit: torch.nn.Module, tok: Any, prompt_ids: list[list[int]]
) -> None:
    params = SamplingParams(n=3, max_new_tokens=12, seed=11)
    with holding(engine, tiny_qwen2(tok, seed=1).eval(), overfit):
        whole = engine.generate(prompt_ids, params)
        assert engine.generate(prompt_ids, params) == whole
        first = engine.generate(prompt_ids[:1], params, prompt_keys=[0])
        rest = engine.generate(prompt_ids[1:], params, prompt_keys=[1, 2])
        other = engine.generate(prompt_ids, SamplingParams(n=3, max_new_tokens=12, seed=12))
    key = [(c.response_ids, c.logprobs) for c in whole]
    assert [(c.response_ids, c.logprobs) for c in first + rest] == key
    assert len({tuple(c.response_ids) for c in whole}) > 6
    assert [c.response_ids for c in other] != [c.response_ids for c in whole]


def test_a_batch_larger_than_one_step_samples_with_seeds(
    engine: VLLMEngine, overfit: torch.nn.Module, tok: Any, prompt_ids: list[list[int]]
) -> None:
    # 128 distinct prompts of 20-60 tokens x 4 samples (no prefix-cache hits): more prompt tokens than
    # one scheduler step takes. With chunked prefill on, vLLM 0.32 rewinds a seeded request's
    # generator, which the CPU one cannot do ("CPU Generator does not use offset": the engine process
    # died); the engine turns chunked prefill off there.
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randint(20, 60))] for _ in range(128)]
    params = SamplingParams(n=4, max_new_tokens=4, seed=2)
    with holding(engine, tiny_qwen2(tok, seed=1).eval(), overfit):
        done = engine.generate(prompts, params)
        again = engine.generate(prompts[:3], params)
    assert len(done) == 512 and all(len(c.response_ids) > 0 for c in done)
    assert done[:12] == again  # each row's samples depend on its seed alone, not on the batch


def test_weight_sync_moves_the_engine_to_the_new_weights(
    engine: VLLMEngine, overfit: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    new = real_update(overfit, prompt_ids)
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    before = engine.generate(prompt_ids, greedy)
    # the update changed what the engine must compute: by far more than the tolerance
    assert max_logprob_gap(new, before, 0.0) > 100 * TOL
    engine.update_weights(new, 7)
    assert engine.policy_version == 7
    assert_engine_holds(engine, new, prompt_ids)
    after = engine.generate(prompt_ids, greedy)
    assert max_logprob_gap(overfit, after, 0.0) > 100 * TOL  # no longer the old weights
    engine.load_weights(merged_state_dict(overfit).items(), 8)  # and back
    assert_engine_holds(engine, overfit, prompt_ids)


def test_a_sync_that_does_nothing_fails_the_content_check(
    engine: VLLMEngine, overfit: torch.nn.Module, prompt_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the mutated copy: the engine records the version but its workers never reload
    monkeypatch.setattr(engine.llm, "collective_rpc", lambda *a, **k: [None])
    new = real_update(overfit, prompt_ids)
    engine.update_weights(new, 9)
    assert engine.policy_version == 9
    with pytest.raises(AssertionError, match="engine log-probs differ"):
        assert_engine_holds(engine, new, prompt_ids)


@pytest.mark.parametrize(
    "drop, add",
    [("lm_head.weight", None), ("model.layers.1.mlp.down_proj.weight", None), (None, "model.extra.weight")],
)
def test_an_incomplete_or_foreign_payload_fails_loudly_and_changes_nothing(
    engine: VLLMEngine,
    overfit: torch.nn.Module,
    prompt_ids: list[list[int]],
    drop: str | None,
    add: str | None,
) -> None:
    new = real_update(overfit, prompt_ids)
    weights = merged_state_dict(new)
    assert "lm_head.weight" in weights  # tied: sent under both names
    if drop:
        del weights[drop]
    if add:
        weights[add] = torch.zeros(2)
    version = engine.policy_version
    with pytest.raises(ConfigError, match=r"load_weights\(version 11\): the payload does not match") as e:
        engine.load_weights(weights.items(), 11)
    assert (drop or add) in str(e.value)
    assert engine.policy_version == version
    assert_engine_holds(engine, overfit, prompt_ids)  # the engine kept the weights it had


def test_sleep_and_wake_where_the_platform_has_it(
    engine: VLLMEngine, overfit: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    from vllm.platforms import current_platform

    assert engine.can_sleep == current_platform.is_sleep_mode_available()
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    before = engine.generate(prompt_ids, greedy)
    engine.sleep()  # frees the weights and KV cache where the platform can; a no-op on vLLM's CPU
    engine.wake_up()
    assert engine.generate(prompt_ids, greedy) == before


def test_multi_turn_tool_rollouts_through_vllm_equal_the_hf_engine(
    engine: VLLMEngine, overfit: torch.nn.Module, tok: Any, prompt_ids: list[list[int]], replay: list[Replay]
) -> None:
    spec = MultiTurnSpec(
        max_turns=3, max_tool_calls=2, max_tokens_per_turn=64, max_response_tokens=128, tool_workers=1
    )
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=64)
    tools, renderer = load_tools(["calculator"]), ToolTurnRenderer(HERMES)
    got = multi_turn_generate(engine, tok, prompt_ids, params, tools, spec, renderer)
    ref = multi_turn_generate(HFEngine(overfit, tok), tok, prompt_ids, params, tools, spec, renderer)
    # vLLM = the HF engine, turn by turn: the same segments (roles, ids, tool results), mask and
    # log-probs within the engines' tolerance
    assert [[(t.role, t.ids, [c.result for c in t.calls]) for t in tr.turns] for tr in got] == [
        [(t.role, t.ids, [c.result for c in t.calls]) for t in tr.turns] for tr in ref
    ]
    assert [(t.completion.response_ids, t.loss_mask) for t in got] == [
        (t.completion.response_ids, t.loss_mask) for t in ref
    ]
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.completion.logprobs), torch.tensor(b.completion.logprobs), atol=TOL, rtol=0
        )
    # and the rollouts exercised tools: the fixture checked that the model replays its conversations
    # (a margin at every sampled token), two of which call the calculator and answer with its result
    assert [(t.completion.prompt_ids, t.completion.response_ids, t.loss_mask) for t in ref] == list(replay)
    assert [[t.role for t in tr.turns] for tr in got] == [["assistant", "tool", "assistant"]] * 2 + [
        ["assistant"]
    ]
    assert [tr.turns[-1].text for tr in got[:2]] == [tr.turns[1].calls[0].result for tr in got[:2]]
