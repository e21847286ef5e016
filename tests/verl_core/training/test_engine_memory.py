"""What the training engine keeps between optimizer steps (verl_core/training/engine.py): the
gradients are freed at the end of each step, so between updates (generation, log-prob passes) a
model holds its weights and optimizer moments, not a gradient per weight."""

from __future__ import annotations

import torch

from verl_core.training.engine import OptimSpec, TrainEngine


def test_step_applies_the_gradients_then_frees_them() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    spec = OptimSpec(
        lr=0.1, weight_decay=0.0, warmup_steps=0, total_steps=4, scheduler="constant", grad_clip=1e9
    )
    engine = TrainEngine(model, spec)
    seen: list[list[torch.Tensor]] = []
    engine.optimizer.register_step_pre_hook(
        lambda *_: seen.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    )
    x = torch.randn(4, 3)
    engine.step([x], lambda mb: model(mb).sum())

    assert len(seen[0]) == 2  # the optimizer saw the weight's and the bias's gradients ...
    assert all(p.grad is None for p in model.parameters())  # ... which are gone after the step
    # d/dW Σ (xWᵀ + b) = Σ_rows x (each output row), d/db = 4 (rows): AdamW's first step moves
    # every weight by lr · m̂/(√v̂ + ε) = lr · g/|g| = −0.1 · sign(g) (no weight decay)
    for p0, p, g in zip(before, model.parameters(), seen[0], strict=True):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * torch.sign(g), atol=1e-6, rtol=0)
    engine.step([x], lambda mb: model(mb).sum())  # the next step starts from no gradients: same sizes
    assert all(p.grad is None for p in model.parameters())
