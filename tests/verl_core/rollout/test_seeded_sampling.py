"""Per-row seeded sampling (issue 14): the counter hash against a readable Python reference and a
published test vector, its rough uniformity; the HF engine gives a prompt the same samples whether
it comes in one call or split over calls (its ``prompt_keys``), whatever the batch size.
Also the engine with its own copy of the weights (``share_weights=False``): stale until synced."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.verl_core.rollout.conftest import tiny_model
from verl_core.models.loading import apply_lora
from verl_core.rollout import HFEngine, SamplingParams
from verl_core.rollout.sampler import check_prompt_keys
from verl_core.seeding import counter_uniforms, derive_seed, sample_keys, splitmix64

M64 = (1 << 64) - 1


def splitmix64_reference(x: int) -> int:
    """SplitMix64's output function on unsigned Python ints (Steele et al. 2014), mod 2⁶⁴ by hand."""
    z = x & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def as_int64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def test_splitmix64_equals_the_python_reference_on_any_bits() -> None:
    values = [0, 1, -1, 2**63 - 1, -(2**63), 0x9E3779B97F4A7C15 - 2**64, 123456789, -987654321]
    got = splitmix64(torch.tensor(values, dtype=torch.long)).tolist()
    assert got == [as_int64(splitmix64_reference(v & M64)) for v in values]


def test_counter_uniform_of_key_0_step_0_is_splitmix64s_first_output() -> None:
    # SplitMix64 seeded with 0: the first output is 0xE220A8397B1DCDAF (the published test vector);
    # its top 24 bits 0xE220A8 = 14819496, over 2²⁴ = 16777216 → 0.883300304...
    u = counter_uniforms(torch.tensor([0]), 0)
    assert u.dtype == torch.float32 and u.item() == 14819496 / 16777216


def test_counter_uniforms_are_deterministic_batch_independent_and_roughly_uniform() -> None:
    keys = torch.tensor(sample_keys(7, list(range(20000)), [0] * 20000))  # (20000,)
    u0, u1 = counter_uniforms(keys, 0), counter_uniforms(keys, 1)
    assert torch.equal(u0, counter_uniforms(keys, 0))
    assert torch.equal(counter_uniforms(keys[5:9], 0), u0[5:9])  # a row's uniform ignores the batch
    assert u0.min() >= 0 and u0.max() < 1
    # 20000 U[0,1): mean 0.5 ± 0.002 (sd 1/√(12·20000)); 10 bins of 2000 ± 42 (binomial sd): ±8 sd
    assert abs(u0.mean().item() - 0.5) < 0.01
    counts = torch.histc(u0, bins=10, min=0, max=1)
    assert (counts - 2000).abs().max() < 340
    # consecutive steps of a row are uncorrelated: |corr| ≲ 3/√20000 ≈ 0.02
    corr = torch.corrcoef(torch.stack([u0, u1]))[0, 1].item()
    assert abs(corr) < 0.03


def test_sample_keys_use_the_one_seed_mixer() -> None:
    assert sample_keys(3, [5, 6], [0, 1]) == [derive_seed("sample", 3, 5, 0), derive_seed("sample", 3, 6, 1)]


def _tokens(out: list[Any]) -> list[list[int]]:
    return [c.response_ids for c in out]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_split_calls_with_prompt_keys_sample_what_one_call_samples(
    model: Any, tok: Any, prompts: list[str], top_p: float
) -> None:
    params = SamplingParams(n=3, max_new_tokens=10, seed=11, top_p=top_p)
    whole = HFEngine(model, tok, max_batch_size=64).generate(prompts, params)
    small = HFEngine(model, tok, max_batch_size=2)  # other batches, other padding
    first = small.generate(prompts[:1] + prompts[3:], params, prompt_keys=[0, 3])
    second = small.generate(prompts[1:3], params, prompt_keys=[1, 2])
    # whole: prompts 0, 1, 2, 3 × 3 samples in order; first: prompts 0 and 3; second: 1 and 2
    assert _tokens(first) == _tokens(whole[0:3]) + _tokens(whole[9:12])
    assert _tokens(second) == _tokens(whole[3:9])
    assert len({tuple(t) for t in _tokens(whole[0:3])}) > 1  # and samples of one prompt still differ
    torch.testing.assert_close(
        torch.tensor([x for c in first + second for x in c.logprobs]),
        torch.tensor([x for c in whole[0:3] + whole[9:12] + whole[3:9] for x in c.logprobs]),
        atol=1e-5,
        rtol=0,
    )


def test_prompt_keys_choose_the_samples(model: Any, tok: Any, prompts: list[str]) -> None:
    engine = HFEngine(model, tok)
    params = SamplingParams(n=1, max_new_tokens=10, seed=11)
    # the same prompt under key 0 and key 1 draws differently; without keys, key = index in the call
    a = engine.generate([prompts[0], prompts[0]], params)
    assert a[0].response_ids != a[1].response_ids
    assert _tokens(engine.generate([prompts[0]], params, prompt_keys=[1])) == _tokens(a[1:])


def test_prompt_keys_are_checked() -> None:
    assert check_prompt_keys(None, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="2 keys for 3 prompts"):
        check_prompt_keys([0, 1], 3)
    with pytest.raises(ValueError, match="distinct"):
        check_prompt_keys([0, 0, 1], 3)


def test_own_copy_is_stale_until_load_weights(tok: Any, prompts: list[str]) -> None:
    live = tiny_model(tok, seed=1)
    other = tiny_model(tok, seed=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    engine = HFEngine(live, tok, share_weights=False, policy_version=3)
    assert not engine.shares_weights and engine.model is not live and engine.policy_version == 3
    at_start = _tokens(engine.generate(prompts, greedy))
    with torch.no_grad():  # the trainer moves its live module: the copy does not follow
        live.load_state_dict(other.state_dict())
    assert _tokens(engine.generate(prompts, greedy)) == at_start
    engine.load_weights(live.state_dict().items(), 4)
    assert engine.policy_version == 4
    assert _tokens(engine.generate(prompts, greedy)) == _tokens(
        HFEngine(other, tok).generate(prompts, greedy)
    )
    with pytest.raises(ValueError, match="missing"):
        engine.load_weights(list(live.state_dict().items())[1:], 5)
    with pytest.raises(ValueError, match="shares the trainer's live module"):
        HFEngine(live, tok).load_weights(live.state_dict().items(), 1)


def test_own_peft_copy_receives_adapter_versions(tok: Any, prompts: list[str]) -> None:
    from peft import get_peft_model_state_dict

    peft = apply_lora(tiny_model(tok, seed=4), rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
    engine = HFEngine(peft, tok, share_weights=False)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    at_start = _tokens(engine.generate(prompts, greedy))
    with torch.no_grad():  # a "training step" on the live adapter
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert _tokens(engine.generate(prompts, greedy)) == at_start  # stale
    expected = _tokens(HFEngine(copy.deepcopy(peft), tok).generate(prompts, greedy))
    assert expected != at_start
    engine.load_adapter(get_peft_model_state_dict(peft), 1)
    assert engine.policy_version == 1 and _tokens(engine.generate(prompts, greedy)) == expected
    engine.update_weights(peft)  # the one-process convenience: the same adapter, next version
    assert engine.policy_version == 2 and _tokens(engine.generate(prompts, greedy)) == expected
