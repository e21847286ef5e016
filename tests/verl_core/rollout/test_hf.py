"""HFEngine: sampling semantics, log-probs against a training forward, stops, bucketing, state hygiene."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from verl_core.errors import ConfigError
from verl_core.models.loading import apply_lora
from verl_core.models.packed import packed_log_probs, use_varlen_attention
from verl_core.rollout import Completion, HFEngine, RolloutEngine, SamplingParams
from verl_core.rollout.requests import cut_at_stop_string, plan_batches
from verl_core.rollout.sampler import sample_inverse_cdf

from .conftest import tiny_model


def key(completions: list[Completion]) -> list[tuple[int, int, list[int], list[int]]]:
    return [(c.prompt_index, c.sample_index, c.prompt_ids, c.response_ids) for c in completions]


def greedy_loop(model: torch.nn.Module, ids: list[int], max_new: int, stops: set[int]) -> list[int]:
    """The readable reference: full forward each step, argmax of the last position."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in stops:
                break
    return out


def test_is_a_rollout_engine(model: Any, tok: Any) -> None:
    assert isinstance(HFEngine(model, tok), RolloutEngine)


def test_seed_determinism_different_seeds_and_caller_rng_untouched(
    model: Any, tok: Any, prompts: list[str]
) -> None:
    engine = HFEngine(model, tok)
    params = SamplingParams(n=2, max_new_tokens=12, seed=7)
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    a = engine.generate(prompts, params)
    assert torch.equal(torch.get_rng_state(), rng_before)  # seeded generation forks the RNG
    b = engine.generate(prompts, params)
    assert a == b
    c = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=12, seed=8))
    assert key(a) != key(c)


def test_n_samples_in_prompt_then_sample_order(model: Any, tok: Any, prompts: list[str]) -> None:
    out = HFEngine(model, tok).generate(prompts, SamplingParams(n=3, max_new_tokens=4, seed=0))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(i, j) for i in range(4) for j in range(3)]
    for c in out:
        assert c.prompt_ids == tok.encode(prompts[c.prompt_index], add_special_tokens=False)
        assert len(c.logprobs) == len(c.response_ids)
    assert len({tuple(c.response_ids) for c in out if c.prompt_index == 0}) > 1  # samples differ


def test_greedy_equals_argmax_loop(model: Any, tok: Any, prompts: list[str]) -> None:
    engine = HFEngine(model, tok, max_batch_size=2)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10))
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    for c in out:
        ref = greedy_loop(model, c.prompt_ids, 10, stops)
        assert c.response_ids == ref
        assert c.finish_reason == ("stop" if ref[-1] in stops else "length")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=1),
        # log-probs are of softmax(logits / T) before top-k/top-p truncation
        SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=16, seed=2),
        SamplingParams(temperature=0, max_new_tokens=16),  # greedy: log-probs at T = 1
    ],
    ids=["T=1", "T=0.7-topk-topp", "greedy"],
)
def test_logprobs_equal_training_forward(tok: Any, prompts: list[str], params: SamplingParams) -> None:
    model = tiny_model(tok, seed=3)
    use_varlen_attention(model)  # as the trainer runs it; generate must behave like sdpa
    out = HFEngine(model, tok, max_batch_size=3).generate(prompts, params)
    seqs = [torch.tensor(c.prompt_ids + c.response_ids) for c in out]
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    temperature = 1.0 if params.greedy else params.temperature
    with torch.no_grad():
        lp, _ = packed_log_probs(model.eval(), torch.cat(seqs), cu, temperature=temperature)
    for c, start in zip(out, cu[:-1].tolist(), strict=True):
        p, r = len(c.prompt_ids), len(c.response_ids)
        # position t predicts token t+1: response tokens are predicted at p-1 .. p+r-2
        ref = lp.log_probs[start + p - 1 : start + p + r - 1]
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-5, rtol=0)


def test_stop_token_ids_end_with_stop_and_keep_the_token(model: Any, tok: Any) -> None:
    engine = HFEngine(model, tok)
    params = SamplingParams(max_new_tokens=12, seed=4)  # seeded: the same tokens up to the stop
    free = engine.generate(["Q: 1 + 2"], params)[0]
    stop = free.response_ids[4]
    first = free.response_ids.index(stop)
    (c,) = engine.generate(["Q: 1 + 2"], dataclasses.replace(params, stop_token_ids=(stop,)))
    assert c.finish_reason == "stop"
    assert c.response_ids == free.response_ids[: first + 1]  # stop token kept
    assert c.logprobs == free.logprobs[: first + 1]
    # eos and <|im_end|> are always stop tokens
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert engine._stop_token_ids(SamplingParams()) == [tok.eos_token_id, im_end]


def test_stop_string_cuts_text_and_tokens(model: Any, tok: Any) -> None:
    engine = HFEngine(model, tok)
    params = SamplingParams(max_new_tokens=24, seed=3)  # seeded: the same tokens up to the stop
    free = engine.generate(["Q: 5 + 5"], params)[0]
    ids = free.response_ids
    # a stop string: the text of a printable ASCII token whose first match completes at that token
    for k in range(2, len(ids)):
        piece = tok.decode([ids[k]], skip_special_tokens=True)
        seen = tok.decode(ids[:k], skip_special_tokens=True)
        if piece.isascii() and piece.strip() and piece.isprintable() and piece not in seen:
            break
    else:
        pytest.fail(f"no usable stop string in {tok.decode(ids)!r}")
    (c,) = engine.generate(["Q: 5 + 5"], dataclasses.replace(params, stop=("zz-never", piece)))
    assert c.finish_reason == "stop"
    assert c.response_ids == ids[: k + 1]  # the token completing the match is kept
    text = tok.decode(ids[: k + 1], skip_special_tokens=True)
    assert c.response_text == text[: text.find(piece) + len(piece)]
    assert c.logprobs == free.logprobs[: k + 1]


def test_cut_at_stop_string_by_hand(tok: Any) -> None:
    ids = tok.encode("A: 12 = ? B", add_special_tokens=False)
    keep, text = cut_at_stop_string(tok, ids, ["= ?", "zzz"])  # type: ignore[misc]
    assert text == "A: 12 = ?"
    assert "= ?" in tok.decode(ids[:keep]) and "= ?" not in tok.decode(ids[: keep - 1])
    assert cut_at_stop_string(tok, ids, ["zzz"]) is None


def test_max_new_tokens_gives_length(model: Any, tok: Any, prompts: list[str]) -> None:
    out = HFEngine(model, tok).generate(prompts, SamplingParams(n=2, max_new_tokens=3, seed=0))
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    assert any(c.finish_reason == "length" for c in out)
    for c in out:
        if c.finish_reason == "length":
            assert len(c.response_ids) == 3 and not stops & set(c.response_ids)
        else:
            assert c.response_ids[-1] in stops


def test_string_and_id_prompts_give_the_same_result(model: Any, tok: Any, prompts: list[str]) -> None:
    engine = HFEngine(model, tok)
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    assert engine.generate(prompts, params) == engine.generate(ids, params)


def test_bucketing_restores_order(model: Any, tok: Any, prompts: list[str]) -> None:
    params = SamplingParams(n=2, temperature=0, max_new_tokens=8)
    one_batch = HFEngine(model, tok, max_batch_size=64).generate(prompts, params)
    bucketed = HFEngine(model, tok, max_batch_size=3, max_batch_tokens=60).generate(prompts, params)
    assert key(bucketed) == key(one_batch)
    torch.testing.assert_close(
        torch.tensor([x for c in bucketed for x in c.logprobs]),
        torch.tensor([x for c in one_batch for x in c.logprobs]),
        atol=1e-5,
        rtol=0,
    )


def test_plan_batches_by_hand() -> None:
    # lengths 5, 1, 3, 1 → by length: request 1 (1), 3 (1), 2 (3), 0 (5)
    assert plan_batches([5, 1, 3, 1], 4, max_batch_size=2) == [[1, 3], [2, 0]]
    # token budget 14 with max_new 4: [1,3] → 2·(1+4)=10 ok; +2 → 3·(3+4)=21 > 14: new batch;
    # [2] 7, +0 → 2·(5+4)=18 > 14: new batch
    assert plan_batches([5, 1, 3, 1], 4, max_batch_size=8, max_batch_tokens=14) == [[1, 3], [2], [0]]
    assert plan_batches([100], 4, max_batch_size=8, max_batch_tokens=1) == [[0]]  # one row always fits


def test_sample_inverse_cdf_never_picks_zero_probability_and_matches_distribution() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8]]).repeat(20000, 1)
    draws = sample_inverse_cdf(probs).squeeze(-1)
    assert set(draws.tolist()) <= {1, 3}
    assert abs((draws == 3).float().mean().item() - 0.8) < 0.015  # 0.8 ± ~5 standard errors
    assert sample_inverse_cdf(torch.tensor([[0.0, 0.0, 1.0]])).item() == 2


def test_peft_model_in_place_and_update_weights_swaps(tok: Any, prompts: list[str]) -> None:
    base = tiny_model(tok, seed=4)
    plain = copy.deepcopy(base).eval()
    peft = apply_lora(base, rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
    peft.train()
    engine = HFEngine(peft, tok)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    # LoRA starts as the identity (B = 0): same samples as the plain model
    assert key(engine.generate(prompts, greedy)) == key(HFEngine(plain, tok).generate(prompts, greedy))
    assert peft.training  # the train flag is restored
    with torch.no_grad():  # a "training step" on the live adapter: the engine sees it, no update needed
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    changed = engine.generate(prompts, greedy)
    assert key(changed) != key(HFEngine(plain, tok).generate(prompts, greedy))
    engine.update_weights(plain)
    assert engine.model is plain
    assert key(engine.generate(prompts, greedy)) == key(HFEngine(plain, tok).generate(prompts, greedy))


def test_caller_state_untouched(model: Any, tok: Any, prompts: list[str]) -> None:
    tok.padding_side = "right"
    model.train()
    config_before = model.generation_config.to_dict()
    HFEngine(model, tok).generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=0, stop=("=",)))
    assert tok.padding_side == "right"
    assert model.training
    assert model.generation_config.to_dict() == config_before
    assert not model.config.use_cache
    model.eval()


def test_prompt_longer_than_the_model_allows_names_the_prompt(tok: Any) -> None:
    model = tiny_model(tok, max_positions=24)
    ids = [[5] * 4, [5] * 20]
    with pytest.raises(ConfigError, match=r"prompt 1: 20 tokens \+ max_new_tokens 8 exceeds .* \(24\)"):
        HFEngine(model, tok).generate(ids, SamplingParams(max_new_tokens=8))


def test_tensor_parallel_is_a_config_error(model: Any, tok: Any) -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        HFEngine(model, tok, tensor_parallel_size=2)


def test_live_model_needs_tokenizer(model: Any) -> None:
    with pytest.raises(ConfigError, match="tokenizer"):
        HFEngine(model)


def test_greedy_logprobs_are_t1_log_softmax(model: Any, tok: Any) -> None:
    (c,) = HFEngine(model, tok).generate(["Q: 1"], SamplingParams(temperature=0, max_new_tokens=1))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([c.prompt_ids]), use_cache=False).logits[0, -1]
    expected = F.log_softmax(logits.float(), -1)[c.response_ids[0]].item()
    assert c.logprobs[0] == pytest.approx(expected, abs=1e-6)
