"""HFEngine decode paths: the own loop (and the compiled path's batch / cache-length bucketing) draws
exactly the tokens of the reference, transformers ``generate`` with the same sampler
(``HFEngine.generate_reference``), with the same behaviour log-probs; the path chosen per device; the
bucket sizes by hand."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

from verl_core.errors import ConfigError
from verl_core.rollout import Completion, HFEngine, SamplingParams, decode
from verl_core.rollout.decode import CompiledStep, bucket, choose_decode

from .conftest import tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def assert_same(out: list[Completion], ref: list[Completion]) -> None:
    """Same tokens, stops and texts; log-probs equal to float32 rounding (the same forwards)."""
    strip = [c._replace(logprobs=[]) for c in out]
    assert strip == [c._replace(logprobs=[]) for c in ref]
    for c, r in zip(out, ref, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-6, rtol=0)


def bucketed(engine: HFEngine) -> HFEngine:
    """``engine`` running the compiled path's bookkeeping (batch and cache length padded to their
    buckets, one reused cache per bucket) with an eager step: what CUDA runs, minus the graphs."""
    engine.decode, engine.compiled_step = "compiled", CompiledStep()
    engine.compiled_step.fallback = "test: eager step on CPU"
    return engine


SAMPLED = SamplingParams(n=3, temperature=1.0, max_new_tokens=14, seed=5)
CASES = {
    "greedy": SamplingParams(n=1, temperature=0, max_new_tokens=12),
    "T=1": SAMPLED,
    "T=0.7-topk-topp": SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, seed=2),
    "max_new=1": dataclasses.replace(SAMPLED, max_new_tokens=1),
}


@pytest.mark.parametrize("params", list(CASES.values()), ids=list(CASES))
@pytest.mark.parametrize("path", ["loop", "bucketed"])
def test_loop_draws_the_tokens_of_generate(
    tok: Any, prompts: list[str], params: SamplingParams, path: str
) -> None:
    model = tiny_model(tok, seed=1)
    ref = HFEngine(model, tok, max_batch_size=3).generate_reference(prompts, params)
    engine = HFEngine(model, tok, max_batch_size=3, decode="loop")  # ragged prompts, several batches
    if path == "bucketed":
        bucketed(engine)
    out = engine.generate(prompts, params)
    assert_same(out, ref)
    if params.max_new_tokens > 1:  # the cases must exercise both endings
        assert {c.finish_reason for c in ref} >= {"length"}


def test_stop_tokens_and_stop_strings_as_generate(
    tok: Any, prompts: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    compactions: list[int] = []
    keep_rows = decode._keep_cache_rows
    monkeypatch.setattr(
        decode, "_keep_cache_rows", lambda c, k: compactions.append(len(k)) or keep_rows(c, k)
    )
    model = tiny_model(tok, seed=1)
    free = HFEngine(model, tok).generate_reference(prompts, SAMPLED)
    # stop tokens: each prompt's first sample's third token; stop strings: the text of a fifth token
    stop_ids = tuple({c.response_ids[2] for c in free if c.sample_index == 0})
    pieces = [
        tok.decode([c.response_ids[4]], skip_special_tokens=True) for c in free if len(c.response_ids) > 4
    ]
    stop = tuple(p for p in pieces if p.strip())[:3]
    assert stop_ids and stop
    for params in (
        dataclasses.replace(SAMPLED, stop_token_ids=stop_ids),
        dataclasses.replace(SAMPLED, stop=stop),
        dataclasses.replace(SAMPLED, stop=stop, stop_token_ids=stop_ids),
    ):
        ref = HFEngine(model, tok, max_batch_size=5).generate_reference(prompts, params)
        assert sum(c.finish_reason == "stop" for c in ref) >= 3  # the stops do fire
        compactions.clear()
        assert_same(HFEngine(model, tok, max_batch_size=5, decode="loop").generate(prompts, params), ref)
        assert compactions  # the loop dropped finished rows from its batch, and drew the same tokens
        compactions.clear()
        engine = bucketed(HFEngine(model, tok, max_batch_size=5, decode="loop"))
        assert_same(engine.generate(prompts, params), ref)
        assert not compactions  # a compiled step keeps its batch shape


def test_bucketed_path_reuses_one_cache_per_bucket(tok: Any, prompts: list[str]) -> None:
    engine = bucketed(HFEngine(tiny_model(tok, seed=1), tok, max_batch_size=16, decode="loop"))
    params = dataclasses.replace(SAMPLED, max_new_tokens=8)
    first = engine.generate(prompts, params)
    # 4 prompts × 3 samples = 12 rows → batch bucket 16; longest prompt + 8 new ≤ 64 → cache bucket 64
    assert list(engine._caches) == [(16, 64)]
    cache = engine._caches[16, 64]
    assert engine.generate(prompts, params) == first  # the reused (reset) cache gives the same samples
    assert engine._caches == {(16, 64): cache}
    engine.sleep()
    assert engine._caches == {}


def test_own_copy_engine_runs_the_loop(tok: Any, prompts: list[str]) -> None:
    model = tiny_model(tok, seed=1)
    own = HFEngine(model, tok, share_weights=False, decode="loop")
    ref = HFEngine(model, tok).generate_reference(prompts, SAMPLED)
    assert_same(own.generate(prompts, SAMPLED), ref)


def test_bucket_sizes_by_hand() -> None:
    # powers of two ≥ n and ≥ smallest: 12 → 16; 3 → 8 (smallest); 64 → 64; 65 → 128
    assert [bucket(n, 8) for n in (12, 3, 64, 65)] == [16, 8, 64, 128]
    # capped at largest when that still holds n: 100 → 128, capped to 112; largest 90 < 100: no cap
    assert bucket(100, 8, 112) == 112 and bucket(100, 8, 90) == 128
    assert bucket(1, 1) == 1


def test_choose_decode_per_device(caplog: pytest.LogCaptureFixture) -> None:
    assert choose_decode("auto", CPU, True)[0] == "loop"  # a CPU compile costs ~1 min: only when asked
    assert choose_decode("auto", CUDA, True)[0] == "compiled"
    assert choose_decode("auto", CUDA, False)[0] == "loop"  # no static cache: eager loop, dynamic cache
    assert choose_decode("compiled", CPU, True)[0] == "compiled"  # inductor without CUDA graphs
    with caplog.at_level(logging.WARNING, logger="verl_core.rollout.decode"):
        path, reason = choose_decode("compiled", CUDA, False)
    assert path == "loop" and "no static KV cache" in reason
    assert "falls back to the eager loop: the model has no static KV cache" in caplog.text


def test_unknown_decode_path_is_a_config_error(model: Any, tok: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"rollout\.decode: expected one of auto, loop, compiled, got 'generate'"
    ):
        HFEngine(model, tok, decode="generate")  # the reference is generate_reference, not a path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled decode step needs CUDA graphs")
def test_compiled_step_on_cuda_matches_the_eager_loop_and_compiles_per_bucket(
    tok: Any, prompts: list[str]
) -> None:
    model = tiny_model(tok, seed=1).cuda()
    params = dataclasses.replace(SAMPLED, temperature=0)  # greedy: robust to kernel-order rounding
    ref = HFEngine(model, tok, decode="loop").generate(prompts, params)
    engine = HFEngine(model, tok, decode="auto")
    assert engine.decode == "compiled" and engine.compiled_step is not None
    out = engine.generate(prompts, params)
    assert engine.compiled_step.fallback is None
    assert [c.response_ids for c in out] == [c.response_ids for c in ref]
    for c, r in zip(out, ref, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=0)
    engine.generate(prompts, params)  # same buckets: no new graph
    assert engine.compiled_step.compiles == 1


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_decode_attention_matches_sdpa(groups: int, mask_kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    b, h_kv, length, d = 3, 2, 7, 8
    q = torch.randn(b, h_kv * groups, 1, d, generator=g)
    k, v = torch.randn(b, h_kv, length, d, generator=g), torch.randn(b, h_kv, length, d, generator=g)
    keep = torch.ones(b, 1, 1, length, dtype=torch.bool)
    keep[0, ..., :3] = False  # row 0: three left pads
    keep[2, ..., 5:] = False  # row 2: two unfilled static-cache slots
    mask = keep if mask_kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    # reference: key heads repeated per query head (transformers' repeat_kv), torch's sdpa, (B, 1, H, D)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=keep, scale=0.3
    ).transpose(1, 2)
    torch.testing.assert_close(decode.decode_attention(q, k, v, mask, 0.3), ref, atol=1e-6, rtol=0)


def test_rollout_with_decode_attention_equals_eager_attention(tok: Any, prompts: list[str]) -> None:
    """transformers' ``eager`` attention (its readable reference, left as it is by the engine) and an
    ``sdpa`` model, which the engine switches to the decode attention for the rollout only."""
    eager = tiny_model(tok, seed=1)
    eager.set_attn_implementation("eager")
    model = tiny_model(tok, seed=1)
    assert model.config._attn_implementation == "sdpa"
    seen: list[str] = []
    attn = model.model.layers[0].self_attn
    attn.register_forward_hook(lambda m, *_: seen.append(m.config._attn_implementation))
    ref = HFEngine(eager, tok, max_batch_size=4, decode="loop").generate(prompts, SAMPLED)
    assert_same(HFEngine(model, tok, max_batch_size=4, decode="loop").generate(prompts, SAMPLED), ref)
    assert set(seen) == {decode.DECODE_ATTENTION}
    assert (model.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")


def test_prefill_runs_each_distinct_prompt_once(tok: Any) -> None:
    """4 rows, 2 distinct prompts (a prompt's n samples): the shared prefill's logits and cached
    keys/values equal one forward of every row."""
    from transformers import DynamicCache

    model = tiny_model(tok, seed=1).eval()
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batches: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: batches.append(args[0].shape[0]))
    with torch.no_grad():
        full, shared = DynamicCache(config=model.config), DynamicCache(config=model.config)
        ref = decode.eager_step(model, ids, positions, mask, full)
        out = decode.prefill(model, ids, positions, mask, shared)
    assert batches == [4, 2]  # the reference ran 4 rows, the shared prefill 2
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    for a, r in zip(shared.layers, full.layers, strict=True):
        torch.testing.assert_close(a.keys, r.keys, atol=1e-6, rtol=0)
        torch.testing.assert_close(a.values, r.values, atol=1e-6, rtol=0)
