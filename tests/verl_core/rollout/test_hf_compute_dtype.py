"""The HF engine's own weight copy in the trainer's compute dtype (bf16 beside fp32 master weights);
a shared module, and the fp32 default, generate exactly as before."""

from __future__ import annotations

from typing import Any

import torch

from verl_core.rollout import HFEngine, SamplingParams

from .conftest import tiny_model


def test_an_own_copy_holds_and_generates_in_the_compute_dtype(tok: Any, prompts: list[str]) -> None:
    trainer = tiny_model(tok, seed=2)  # fp32 master weights
    engine = HFEngine(trainer, tok, share_weights=False, compute_dtype="bfloat16")
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}  # half the memory
    assert {p.dtype for p in trainer.parameters()} == {torch.float32}  # the trainer's are untouched
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6)
    got = engine.generate(prompts, params)
    assert len(got) == 2 * len(prompts) and all(len(c.response_ids) >= 1 for c in got)
    # a sync of the fp32 weights lands in the bf16 copy
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01)
    engine.load_weights(trainer.state_dict().items(), 1)
    name, weight = next(iter(trainer.named_parameters()))
    assert torch.equal(dict(engine.model.named_parameters())[name], weight.detach().to(torch.bfloat16))
    # fp32 compute (the quickstart's): the own copy is the trainer's weights bit for bit
    same = HFEngine(trainer, tok, share_weights=False, compute_dtype="float32")
    fp32 = HFEngine(trainer, tok, share_weights=False)
    assert same.generate(prompts, params) == fp32.generate(prompts, params)
