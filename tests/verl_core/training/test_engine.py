"""Training engine: LR schedule by hand, grad-accumulation invariance, NaN/Inf guard, state round trip."""

from __future__ import annotations

import math

import pytest
import torch

from verl_core.training.engine import NonFiniteError, OptimSpec, TrainEngine, lr_multiplier


def spec(**kw: object) -> OptimSpec:
    base = {"lr": 0.1, "weight_decay": 0.0, "warmup_steps": 0, "total_steps": 10, "scheduler": "constant"}
    base.update(grad_clip=1e9)
    base.update(kw)
    return OptimSpec(**base)  # type: ignore[arg-type]


def test_lr_schedule_by_hand() -> None:
    # warm-up 2 of 6 steps then cosine: step0 1/2, step1 2/2, then ½(1+cos(π·k/4)) for k=0..4
    got = [lr_multiplier(s, warmup_steps=2, total_steps=6, scheduler="cosine") for s in range(6)]
    expected = [0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 + math.cos(3 * math.pi / 4))]
    assert got == pytest.approx(expected)
    assert lr_multiplier(9, warmup_steps=0, total_steps=6, scheduler="cosine") == pytest.approx(0.0)
    assert lr_multiplier(3, warmup_steps=0, total_steps=6, scheduler="constant") == 1.0
    with pytest.raises(ValueError, match="valid: constant, cosine"):
        lr_multiplier(3, warmup_steps=0, total_steps=6, scheduler="linear")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def test_grad_accumulation_invariance_1x8_equals_8x1() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)

    def run(split: int) -> list[torch.Tensor]:
        engine = TrainEngine(_model(), spec(grad_clip=0.5))  # clipping active: norms must agree too
        size = 8 // split
        micro = [(x[i : i + size], y[i : i + size]) for i in range(0, 8, size)]
        for _ in range(3):
            # each micro-batch loss is its share of the mini-batch mean: Σ (ŷ−y)² / 8
            engine.step(micro, lambda mb: ((engine.model(mb[0]) - mb[1]) ** 2).sum() / 8)
        return [p.detach().clone() for p in engine.model.parameters()]

    for a, b in zip(run(1), run(8), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_non_finite_loss_stops_before_the_step() -> None:
    engine = TrainEngine(_model(), spec())
    before = [p.detach().clone() for p in engine.model.parameters()]
    with pytest.raises(NonFiniteError, match=r"sft: loss is nan at step 0, micro-batch 1"):
        engine.step([1.0, float("nan")], lambda v: engine.model(torch.ones(1, 4)).sum() * v, where="sft")
    for p, q in zip(engine.model.parameters(), before, strict=True):
        assert torch.equal(p, q)
    assert engine.global_step == 0


def test_non_finite_gradient_is_named() -> None:
    engine = TrainEngine(_model(), spec())
    # sqrt at 0 has an infinite derivative while the loss itself is finite
    with pytest.raises(NonFiniteError, match="grad_norm is"):
        engine.step([0], lambda _: torch.sqrt(engine.model[0].weight.sum() * 0))


def test_state_round_trip_continues_identically() -> None:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))

    def loss(engine: TrainEngine) -> torch.Tensor:
        return engine.model(x).pow(2).mean()

    straight = TrainEngine(_model(), spec(scheduler="cosine", warmup_steps=1))
    for _ in range(4):
        straight.step([0], lambda _: loss(straight))

    first = TrainEngine(_model(), spec(scheduler="cosine", warmup_steps=1))
    for _ in range(2):
        first.step([0], lambda _: loss(first))
    resumed = TrainEngine(_model(), spec(scheduler="cosine", warmup_steps=1))
    resumed.model.load_state_dict(first.model.state_dict())
    resumed.load_state_dict(first.state_dict())
    for _ in range(2):
        resumed.step([0], lambda _: loss(resumed))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_use_spec_lr_after_loading_another_runs_state() -> None:
    # warm-up 2 of 10 steps, constant after: multipliers 1/2, 1, 1, ...; 3 steps taken → next lr = base·1
    def trained(lr: float) -> TrainEngine:
        engine = TrainEngine(_model(), spec(lr=lr, warmup_steps=2))
        for _ in range(3):
            engine.step([None], lambda _: engine.model(torch.ones(1, 4)).sum())
        return engine

    saved = trained(0.1).state_dict()
    same = TrainEngine(_model(), spec(lr=0.1, warmup_steps=2))
    same.load_state_dict(saved)
    loaded = [g["lr"] for g in same.optimizer.param_groups]
    same.use_spec_lr()  # unchanged lr: exactly the loaded rates (0.1 · 1.0)
    assert [g["lr"] for g in same.optimizer.param_groups] == loaded == [0.1] * len(loaded)
    other = TrainEngine(_model(), spec(lr=0.02, warmup_steps=2))
    other.load_state_dict(saved)
    assert other.optimizer.param_groups[0]["lr"] == 0.1  # the loaded state holds the saved rate
    other.use_spec_lr()
    assert [g["lr"] for g in other.optimizer.param_groups] == [0.02] * len(loaded)
    other.step([None], lambda _: other.model(torch.ones(1, 4)).sum())
    assert other.scheduler.get_last_lr() == pytest.approx([0.02] * len(loaded))  # step 4: 0.02 · 1.0
    assert other.global_step == 4  # the loaded step went on
