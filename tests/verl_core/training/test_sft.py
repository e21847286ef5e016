"""SFT loss: masks by hand, packed loss == per-sequence cross-entropy, micro-batch invariance; the SFT
loop without Prefect: the loss falls, callbacks at the planned steps, resume == uninterrupted."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl_core.data.packing import pack
from verl_core.models.checkpoint import load_state_bytes, rng_state, set_rng_state, state_bytes
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM
from verl_core.training.engine import OptimSpec, TrainEngine
from verl_core.training.sft import (
    SFTCheckpoint,
    SFTLoopSpec,
    batch_rows,
    count_loss_tokens,
    resume,
    sft_loss,
    sft_train,
    target_mask,
    val_loss,
)


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


# six rows of 5-8 tokens, the second half of each an assistant answer
ROWS = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15], [16, 17, 18, 19, 20, 21, 22], [23, 24, 25, 26, 27]]
ROWS += [[28, 29, 30, 31, 32, 33, 34, 35], [36, 37, 38, 39, 40, 41]]
DATA = (ROWS, [[0] * (len(r) // 2) + [1] * (len(r) - len(r) // 2) for r in ROWS])
CPU = torch.device("cpu")


def loop_spec(**kw: int) -> SFTLoopSpec:
    # 6 rows, 2 per step: 3 steps per epoch, 2 epochs
    base = {"total_steps": 6, "steps_per_epoch": 3, "batch_size": 2, "token_budget": 16}
    base.update(val_every=3, log_every=4, save_every=2, seed=0)
    base.update(kw)
    return SFTLoopSpec(**base)


def engine_of(seed: int = 0) -> TrainEngine:
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 64)
    lm = init_causal_lm(scratch_config(spec, 50, eos_token_id=0, pad_token_id=0), seed=seed)
    optim = OptimSpec(
        lr=1e-2, weight_decay=0.0, warmup_steps=1, total_steps=6, scheduler="cosine", grad_clip=1.0
    )
    return TrainEngine(PackedCausalLM(lm), optim)


def weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_batch_rows_are_an_epoch_permutation() -> None:
    # steps 0-2 of epoch 0 cover the 6 rows once, 2 each; step 3 starts epoch 1 (another permutation)
    epoch0 = [batch_rows(6, 2, step, 3, seed=0) for step in range(3)]
    assert sorted(r for rows in epoch0 for r in rows) == list(range(6))
    assert all(len(rows) == 2 for rows in epoch0)
    assert batch_rows(6, 2, 3, 3, seed=0) == batch_rows(6, 2, 3, 3, seed=0)
    assert batch_rows(6, 2, 3, 4, seed=0) == []  # a 4th step of 2 rows in an epoch of 6: out of rows


def test_loop_lowers_the_loss_and_calls_back_at_the_planned_steps() -> None:
    engine = engine_of()
    logged: list[int] = []
    saved: list[int] = []
    losses: list[float] = []
    run = sft_train(
        engine, DATA, DATA, loop_spec(), device=CPU,
        on_log=lambda step, metrics: logged.append(step),
        on_checkpoint=lambda c: saved.append(c.step), on_step=losses.append,
    )  # fmt: skip
    assert run.completed == 6 and len(losses) == 6
    assert logged == [4, 6]  # every log_every=4 steps, and the last
    assert saved == [2, 4]  # every save_every=2 steps but the last (the stage commits it)
    # validation before step 0 and every val_every=3 steps but the last (the stage's final one)
    assert [s for s, k, _ in run.history if k == "sft/val_loss"] == [0, 3]
    first = run.history[0][2]
    assert val_loss(engine, DATA, 16, CPU) < first  # trained on the validation rows themselves
    assert [k for s, k, _ in run.history if s == 4] == [
        "sft/loss",
        "sft/grad_norm",
        "sft/lr",
        "perf/sft_tokens_per_s",
    ]


def test_resume_from_a_checkpoint_ends_with_the_uninterrupted_weights() -> None:
    whole = engine_of()
    uninterrupted = sft_train(whole, DATA, DATA, loop_spec(), device=CPU)

    saved: dict[int, bytes] = {}

    def keep(c: SFTCheckpoint) -> None:  # what the stage commits, serialised at once
        saved[c.step] = state_bytes({"weights": weights(first), "state": c.trainer_state})

    first = engine_of()
    sft_train(first, DATA, DATA, loop_spec(), device=CPU, on_checkpoint=keep)
    ckpt = load_state_bytes(saved[4], "test")
    resumed = engine_of(seed=1)  # other start weights: the checkpoint's replace them
    resumed.model.load_state_dict(ckpt["weights"])
    start, history = resume(resumed, ckpt["state"])
    assert start == 4
    run = sft_train(resumed, DATA, DATA, loop_spec(), device=CPU, start=start, history=history)
    assert run.completed == 6
    for k, v in weights(whole).items():
        assert torch.equal(weights(resumed)[k], v), k

    def values(h: list[tuple[int, str, float]]) -> list[tuple[int, str, float]]:
        return [x for x in h if not x[1].startswith("perf/")]  # throughput is wall-clock

    assert values(run.history) == values(uninterrupted.history)
