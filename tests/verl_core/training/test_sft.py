"""SFT loss: masks by hand, packed loss == per-sequence cross-entropy, micro-batch invariance."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl_core.data.packing import pack
from verl_core.models.checkpoint import load_state_bytes, rng_state, set_rng_state, state_bytes
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM
from verl_core.training.sft import count_loss_tokens, sft_loss, target_mask


def test_target_mask_by_hand() -> None:
    # two sequences [p p a a] and [p a]: targets are the next tokens; loss targets are assistant tokens
    loss_mask = torch.tensor([0, 0, 1, 1, 0, 1], dtype=torch.int8)
    has_target = torch.tensor([True, True, True, False, True, False])
    # position 1 predicts token 2 (a) ✓, position 2 predicts token 3 (a) ✓, 3 is last; position 4 predicts 5 ✓
    assert target_mask(loss_mask, has_target).tolist() == [0, 1, 1, 0, 1, 0]
    assert count_loss_tokens([[0, 0, 1, 1], [0, 1]]) == 3


def test_sft_loss_equals_masked_cross_entropy() -> None:
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 64)
    model = init_causal_lm(scratch_config(spec, 50, eos_token_id=0, pad_token_id=0), seed=0)
    seqs = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    masks = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 0, 0, 1]]
    batch = pack(seqs, loss_masks=masks)
    n = count_loss_tokens(masks)  # 3 + 2 + 1 = 6
    assert n == 6
    assert batch.loss_mask is not None
    packed = PackedCausalLM(model)
    loss, _ = sft_loss(packed, batch.input_ids, batch.cu_seqlens, batch.loss_mask, num_loss_tokens=n)

    ref_sum = torch.zeros(())
    for s, m in zip(seqs, masks, strict=True):
        ids = torch.tensor(s)
        logits = model(input_ids=ids[None], use_cache=False).logits[0]
        ce = F.cross_entropy(logits[:-1], ids[1:], reduction="none")  # (T-1,)
        ref_sum = ref_sum + (ce * torch.tensor(m[1:]).float()).sum()
    torch.testing.assert_close(loss, ref_sum / 6, atol=1e-5, rtol=0)

    # micro-batches with the mini-batch normaliser sum to the mini-batch loss
    parts = [pack(seqs[:1], loss_masks=masks[:1]), pack(seqs[1:], loss_masks=masks[1:])]
    total = sum(
        sft_loss(packed, p.input_ids, p.cu_seqlens, p.loss_mask, num_loss_tokens=n)[0]  # type: ignore[arg-type]
        for p in parts
    )
    torch.testing.assert_close(total, loss, atol=1e-6, rtol=0)


def test_trainer_state_bytes_round_trip_and_rng() -> None:
    state = {"step": 3, "w": torch.arange(4.0), "nested": {"a": [1, 2]}, "rng": rng_state()}
    back = load_state_bytes(state_bytes(state), "test")
    assert back["step"] == 3 and torch.equal(back["w"], torch.arange(4.0)) and back["nested"] == {"a": [1, 2]}
    set_rng_state(back["rng"])
    a = torch.rand(3)
    set_rng_state(back["rng"])
    assert torch.equal(torch.rand(3), a)
