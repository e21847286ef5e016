"""GradScratchAdamW: bit-identical to torch.optim.AdamW(foreach=False), same state, no fresh denom."""

from __future__ import annotations

import pytest
import torch

from verl_core.training.adamw import GradScratchAdamW


def _params(seed: int) -> list[torch.nn.Parameter]:
    # odd sizes (not multiples of a vector width, split unevenly between 2 threads) and ≥ 2 threads'
    # grain (32,768 elements) so the parallel split and the scalar tails are exercised
    g = torch.Generator().manual_seed(seed)
    shapes = [(257, 131), (70_001,), (3,), (5, 7)]
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _groups(params: list[torch.nn.Parameter]) -> list[dict[str, object]]:
    return [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "weight_decay": 0.0}]


@pytest.mark.parametrize("threads", [1, 2])
def test_bit_identical_to_torch_adamw(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, new = _params(0), _params(0)
        opt_ref = torch.optim.AdamW(_groups(ref), lr=1e-3, betas=(0.9, 0.999), foreach=False)
        opt_new = GradScratchAdamW(_groups(new), lr=1e-3, betas=(0.9, 0.999), foreach=False)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):  # grads of large and tiny magnitude: sqrt(v) near ε matters
            for a, b in zip(ref, new, strict=True):
                scale = 10.0 ** float(torch.randint(-6, 2, (), generator=g))
                grad = torch.randn(a.shape, generator=g) * scale
                a.grad, b.grad = grad.clone(), grad.clone()
            opt_ref.step()
            opt_new.step()
        for a, b in zip(ref, new, strict=True):
            assert torch.equal(a, b)  # bitwise, every element
        sr, sn = opt_ref.state_dict(), opt_new.state_dict()
        assert sr["param_groups"] == sn["param_groups"]
        for k, st in sr["state"].items():
            assert st.keys() == sn["state"][k].keys()
            assert all(torch.equal(st[x], sn["state"][k][x]) for x in st)
    finally:
        torch.set_num_threads(before)


def test_denom_lands_in_the_gradient() -> None:
    # step 1 from zero moments, no decay: v = (1 − β₂)·g², sqrt(v)/sqrt(1 − β₂) = |g|, so the
    # gradient's storage holds |g| + ε afterwards (the same storage: nothing fresh was allocated)
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([1.0, -2.0, 3.0, -4.0])
    storage = p.grad.data_ptr()
    GradScratchAdamW([p], lr=0.1, weight_decay=0.0, foreach=False).step()
    assert p.grad.data_ptr() == storage
    torch.testing.assert_close(p.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]) + 1e-8)
    # m = 0.1·g, m / (1 − β₁) = g: p = −0.1 · g / (|g| + ε) ≈ −0.1·sign(g)
    torch.testing.assert_close(p.detach(), torch.tensor([-0.1, 0.1, -0.1, 0.1]))


def test_falls_back_off_the_plain_path() -> None:
    # AMSGrad is not the single-tensor plain path: torch's own step, the gradient left as it was
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    GradScratchAdamW([p], lr=0.1, amsgrad=True, foreach=False).step()
    assert torch.equal(p.grad, torch.ones(3))
