"""Reproducible updates on CPU: every gather that gradients flow back through is ``take``
(``index_select``, whose backward adds rows in index order), never ``x[index]`` (whose backward,
``index_put_`` with accumulate, adds them in CPU-thread order: two runs of one update differed in the
last bit, and the quickstart's checkpoints with them). A dispatch mode counts the accumulating
``index_put`` calls of a whole PPO iteration (actor, critic, reference; each CPU attention backend,
shared prompts on and off) and must find none; tests/reliability/test_determinism.py runs the
whole RL phase twice."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.verl_core.training.test_ppo_iteration import make_models, make_spec, run
from verl_core.models.attention import take
from verl_core.models.packed import PackedCausalLM, PackedScoreModel

_INDEX_PUTS = {"aten.index_put.default", "aten.index_put_.default", "aten._index_put_impl_.default"}


class AccumulatingIndexPuts(TorchDispatchMode):
    """Counts ``index_put`` calls with ``accumulate=True`` (the ops that add in thread order on CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if str(func) in _INDEX_PUTS and (kwargs.get("accumulate") or (len(args) > 3 and args[3])):
            self.count += 1
        return func(*args, **kwargs)


def test_take_by_hand() -> None:
    x = torch.arange(12.0).view(3, 4)  # rows [0 1 2 3], [4 5 6 7], [8 9 10 11]
    index = torch.tensor([[2, 0], [1, 1]])
    got = take(x, index)  # (2, 2, 4): rows 2, 0 / 1, 1
    assert got.shape == (2, 2, 4)
    assert got[0, 0].tolist() == [8, 9, 10, 11] and got[1, 1].tolist() == [4, 5, 6, 7]
    # along dim 1: columns 3 and 0 of each row
    assert take(x, torch.tensor([3, 0]), 1).tolist() == [[3, 0], [7, 4], [11, 8]]
    # gradient: row 0 taken once, row 1 twice, row 2 once
    w = x.clone().requires_grad_(True)
    take(w, index).sum().backward()
    assert w.grad is not None and w.grad[:, 0].tolist() == [1, 2, 1]


def test_the_counter_sees_an_indexing_backward() -> None:
    # without this the next test could pass by counting nothing
    x = torch.randn(5, 3, requires_grad=True)
    with AccumulatingIndexPuts() as puts:
        x[torch.tensor([0, 4, 0])].sum().backward()
    assert puts.count >= 1


def _attention(models: Any, name: str) -> None:
    for module in models.actor.modules(), *([] if models.critic is None else [models.critic.modules()]):
        for m in module:
            if isinstance(m, PackedCausalLM | PackedScoreModel) and hasattr(m, "attention"):
                m.attention = name


@pytest.mark.parametrize("attention", ["bucketed", "padded"])
@pytest.mark.parametrize("share_prompts", [True, False])
def test_a_ppo_iteration_never_accumulates_in_thread_order(attention: str, share_prompts: bool) -> None:
    models = make_models(critic=True, ref=True)
    _attention(models, attention)
    spec = make_spec(adv_estimator="gae", use_kl_loss=True, share_prompts=share_prompts)
    with AccumulatingIndexPuts() as puts:
        run(models, spec)
    assert puts.count == 0
