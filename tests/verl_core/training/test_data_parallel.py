"""Data-parallel planning (every rank computes every rank's plan): the Karmarkar–Karp split, padding
micro-batches so all ranks make the same number of calls, the SFT step plan, and the engine factory's
errors. The 2-rank runs are in test_dp_equivalence.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from verl_core.errors import ConfigError
from verl_core.training.data_parallel import (
    DPView,
    MicroBatch,
    dp_micro_batches,
    dp_split,
    dp_view,
    micro_batches,
)
from verl_core.training.engine import OptimSpec, SingleStrategy, TrainEngine
from verl_core.training.sft import sft_step_plan
from verl_core.training.strategies import build_train_engine, prepare_frozen

# rows 0..5 with lengths 10, 2, 3, 4, 9, 1 (49 tokens)
LENGTHS = [10, 2, 3, 4, 9, 1]
OPTIM = OptimSpec(
    lr=1e-3, weight_decay=0.0, warmup_steps=0, total_steps=1, scheduler="constant", grad_clip=1.0
)


def test_split_over_two_ranks_by_hand() -> None:
    # Karmarkar–Karp with equal sizes: sorted lengths 1,2 | 3,4 | 9,10 pair up as {2},{1} · {4},{3} ·
    # {10},{9}; merging the first two (largest set with smallest) gives {2+3},{1+4} = rows {1,2},{5,3};
    # merging that with {10},{9}: {10+5},{9+5} → rows {0,3,5} (15 tokens) and {1,2,4} (14 tokens)
    assert dp_split(range(6), LENGTHS, 2) == [[0, 3, 5], [1, 2, 4]]
    assert dp_split(range(6), LENGTHS, 1) == [[0, 1, 2, 3, 4, 5]]
    # fewer rows than ranks: a rank gets nothing
    assert dp_split([4], LENGTHS, 2) == [[4], []]


def test_the_rank_with_fewer_micro_batches_pads_with_weight_zero() -> None:
    # budget 14: rank 0's 15 tokens need 2 micro-batches ({10} and {4, 1}), rank 1's 14 tokens fit
    # in one, so rank 1 runs one padding micro-batch: the shortest row of the step (row 5, 1 token)
    plans = [dp_micro_batches(range(6), LENGTHS, 14, DPView(r, 2, None)) for r in range(2)]
    assert plans[0] == [MicroBatch([0], 1.0), MicroBatch([3, 5], 1.0)]
    assert plans[1] == [MicroBatch([1, 2, 4], 1.0), MicroBatch([5], 0.0)]
    # every real row exactly once over the ranks
    real = sorted(r for plan in plans for mb in plan if mb.weight for r in mb.rows)
    assert real == list(range(6))
    # one process: no padding, the plain token-budget micro-batches
    assert all(mb.weight == 1.0 for mb in dp_micro_batches(range(6), LENGTHS, 14, DPView(0, 1, None)))
    # a mini-batch of one row over two ranks: rank 1 runs it as padding
    assert dp_micro_batches([4], LENGTHS, 14, DPView(1, 2, None)) == [MicroBatch([4], 0.0)]
    # fixed micro-batch size 2: rank 0 [0, 3], [5]; rank 1 [1, 2], [4]
    fixed = [dp_micro_batches(range(6), LENGTHS, 14, DPView(r, 2, None), fixed=2) for r in range(2)]
    assert [[mb.rows for mb in p] for p in fixed] == [[[0, 3], [5]], [[1, 2], [4]]]


def test_sft_step_plan_counts_the_loss_tokens_of_the_whole_step() -> None:
    # loss targets per row: sum(mask[1:]) → 2, 1, 0, 3, ... ; the step takes rows 0, 1, 3: 2 + 1 + 3 = 6
    masks = [[0, 1, 1], [0, 0, 1], [1, 0], [0, 1, 1, 1]]
    lengths = [3, 3, 2, 4]
    plans = [sft_step_plan([0, 1, 3], lengths, masks, 4, DPView(r, 2, None)) for r in range(2)]
    assert [p.num_loss_tokens for p in plans] == [6, 6]
    # 3 rows over 2 ranks (not equal sizes): KK gives {4} | {3, 3} → rank 0 rows [0, 1] (6 tokens:
    # 2 micro-batches of ≤ 4), rank 1 row [3] (4 tokens: one) + one padding micro-batch (row 0, 3 tokens)
    assert plans[0].micro_batches == [MicroBatch([0], 1.0), MicroBatch([1], 1.0)]
    assert plans[1].micro_batches == [MicroBatch([3], 1.0), MicroBatch([0], 0.0)]


def test_dp_view_of_engines() -> None:
    assert dp_view(TrainEngine(torch.nn.Linear(2, 2), OPTIM, SingleStrategy())) == DPView(0, 1, None)
    # a strategy that reports its data-parallel view (tensor parallelism: dp_size = world / tp)
    tp = SimpleNamespace(strategy=SimpleNamespace(world_size=4, dp_rank=1, dp_size=2, dp_group=None))
    assert dp_view(tp) == DPView(1, 2, None)


def test_engine_factory_errors_name_the_field() -> None:
    model = torch.nn.Linear(2, 2)
    engine = build_train_engine(model, OPTIM, strategy="single", device="cpu")
    assert isinstance(engine, TrainEngine) and isinstance(engine.strategy, SingleStrategy)
    with pytest.raises(
        ConfigError, match=r"actor.strategy: unknown strategy 'ddp'; valid: single, fsdp2, deepspeed"
    ):
        build_train_engine(model, OPTIM, strategy="ddp", device="cpu")
    launch = r"launch with trainer.n_gpus_per_node > 1 or under torchrun"
    with pytest.raises(
        ConfigError, match=r"critic.strategy: fsdp2 needs torch.distributed initialised: " + launch
    ):
        build_train_engine(model, OPTIM, strategy="fsdp2", device="cpu", role="critic")
    with pytest.raises(
        ConfigError, match=r"actor.tensor_parallel_size: 2 needs actor.strategy fsdp2, not single"
    ):
        build_train_engine(model, OPTIM, strategy="single", device="cpu", tp_size=2)
    with pytest.raises(
        ConfigError, match=r"actor.param_offload: true needs actor.strategy fsdp2 or deepspeed"
    ):
        build_train_engine(model, OPTIM, strategy="single", device="cpu", param_offload=True)
    with pytest.raises(
        ConfigError, match=r"ref.strategy: unknown strategy 'deepspeed'; valid: single, fsdp2"
    ):
        prepare_frozen(model, "deepspeed", "cpu")
    frozen = prepare_frozen(torch.nn.Linear(2, 2).train(), "single", "cpu")
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=r"actor.zero_stage: 4; valid: 1, 2, 3"):
            build_train_engine(model, OPTIM, strategy="deepspeed", device="cpu", zero_stage=4)
        with pytest.raises(
            ConfigError, match=r"actor.tensor_parallel_size: 2 does not divide the world size 1"
        ):
            build_train_engine(model, OPTIM, strategy="fsdp2", device="cpu", tp_size=2)
    finally:
        dist.destroy_process_group()


def test_a_padding_micro_batch_adds_exactly_zero_gradient() -> None:
    # rank 1's SFT plan above: row 3, then row 0 as padding (weight 0); the step with the padding
    # micro-batch must leave bit-identical weights to the step without it
    from verl_core.data.packing import pack
    from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
    from verl_core.models.packed import PackedCausalLM
    from verl_core.training.sft import sft_loss

    seqs = [[5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15, 16]]
    masks = [[0, 1, 1], [0, 0, 1], [1, 0], [0, 1, 1, 1]]
    plan = sft_step_plan([0, 1, 3], [3, 3, 2, 4], masks, 4, DPView(1, 2, None))
    assert plan.micro_batches[-1].weight == 0.0
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 64)
    results = []
    for micro in (plan.micro_batches, plan.micro_batches[:-1]):
        lm = init_causal_lm(scratch_config(spec, 20, eos_token_id=0, pad_token_id=0), seed=0)
        engine = TrainEngine(PackedCausalLM(lm), OPTIM)

        def loss(mb: MicroBatch, model: Any = engine.model) -> torch.Tensor:
            p = pack([seqs[i] for i in mb.rows], loss_masks=[masks[i] for i in mb.rows])
            assert p.loss_mask is not None
            n = plan.num_loss_tokens
            return sft_loss(model, p.input_ids, p.cu_seqlens, p.loss_mask, num_loss_tokens=n)[0] * mb.weight

        stats = engine.step(micro, loss)
        results.append((stats.loss, {k: v.clone() for k, v in lm.state_dict().items()}))
    (loss_a, wa), (loss_b, wb) = results
    assert loss_a == loss_b
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_shared_prompt_micro_batches_keep_groups_and_count_stored_tokens() -> None:
    # rows 0-2: prompt A (10 tokens) + responses of 5; rows 3-4: prompt B (10) + responses of 20
    prompts = [[1] * 10] * 3 + [[2] * 10] * 2
    lengths = [15, 15, 15, 30, 30]
    # A costs 10 + 3·5 = 25 stored tokens; B = 10 + 2·20 = 50 > 40, so B is cut into runs that fit:
    # [3] (30) and [4] (30). Units 25, 30, 30 (85) → ceil(85/40) = 3 micro-batches, one unit each.
    parts = micro_batches([0, 1, 2, 3, 4], lengths, 40, prompts=prompts)
    assert sorted(parts) == [[0, 1, 2], [3], [4]]
    # at 60 B fits whole (50): 25 + 50 = 75 → 2 micro-batches; without prompts the rows' full
    # lengths (105) would need 2 and split the groups by length balance
    assert sorted(micro_batches([0, 1, 2, 3, 4], lengths, 60, prompts=prompts)) == [[0, 1, 2], [3, 4]]
    # fixed sizes ignore prompts
    assert micro_batches([0, 1, 2, 3, 4], lengths, 40, fixed=2, prompts=prompts) == [[0, 1], [2, 3], [4]]
