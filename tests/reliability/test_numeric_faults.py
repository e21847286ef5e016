"""Numeric faults: a NaN/Inf injected into the policy's logits (training forward, or the no-grad
old-log-prob forward), its loss or its gradients during iteration 1 stops the update before any
optimizer step is committed; the error names the iteration and the tensor; the checkpoint of
iteration 1 (and the update of iteration 0 it published) stay intact and loadable."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import flows.rl as rl_flow
import verl_core.training.ppo as ppo_module
from flows.rl import rl_loop
from stages.floor.locations import list_checkpoints
from stages.floor.opening import open_session
from stages.floor.session import RLSession, session_of
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig
from verl_core.runtime.run import RunContext
from verl_core.training.engine import NonFiniteError

CFG = VerlFlowConfig.model_validate(
    {
        "data": {
            "arithmetic_train_size": 32,
            "arithmetic_val_size": 4,
            "train_batch_size": 2,
            "max_response_length": 8,
            "truncation": "right",
        },
        "model": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "actor": {"lr": 1e-3, "ppo_mini_batch_size": 1},
        "critic": {"lr": 1e-3, "ppo_mini_batch_size": 1},
        "rollout": {"n": 2},
        "algorithm": {"adv_estimator": "gae"},
        "reward": {"scorers": [{"name": "function"}], "function": "tests.flows.rl_rewards:digit_count"},
        "trainer": {
            "total_iterations": 2,
            "save_freq": 1,
            "test_freq": 0,
            "val_before_train": False,
            "device": "cpu",
        },
        "execution": {"task_retries": 0},
        "tracking": {"enabled": False},
    }
)
NAN = float("nan")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("numeric")
    ctx = RunContext(run_id="data", store_url=str(root))
    return root, template_pack.fn(ctx, CFG.data, CFG.model, preprocess.fn(ctx, CFG.data))


def _final_norm(state: RLSession) -> torch.nn.Module:
    return state.lm.get_decoder().norm  # type: ignore[no-any-return]


@contextmanager
def _logits(value: float, with_grad: bool, state: RLSession) -> Iterator[None]:
    """Every logit of the policy's forward becomes ``value`` (through the last norm's output)."""

    def hook(module: torch.nn.Module, inputs: Any, out: torch.Tensor) -> torch.Tensor | None:
        return out * value if torch.is_grad_enabled() == with_grad else None

    handle = _final_norm(state).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _loss(value: float, state: RLSession) -> Iterator[None]:
    real = ppo_module.actor_loss

    def actor_loss(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        return out._replace(loss=out.loss * value)

    ppo_module.actor_loss = actor_loss  # type: ignore[assignment]
    try:
        yield
    finally:
        ppo_module.actor_loss = real


@contextmanager
def _gradient(value: float, state: RLSession) -> Iterator[None]:
    param = next(p for n, p in state.actor.named_parameters() if n.endswith("q_proj.weight"))
    handle = param.register_hook(lambda g: g * value)
    try:
        yield
    finally:
        handle.remove()


Inject = Callable[[RLSession], Any]
LOSS_NAN = r"^ppo_update: iteration 1 actor: loss is nan at step \d+, micro-batch 0$"
OLD_LOGP = r"^ppo_update: iteration 1: old_log_probs contains NaN/Inf \(before any optimizer step\)$"
GRAD_INF = (
    r"^ppo_update: iteration 1 actor: grad_norm is (inf|nan) at step \d+ "
    r"\(non-finite gradient of lm\.model\.layers\.0\.self_attn\.q_proj\.weight"
)
CASES: list[tuple[str, Inject, str]] = [
    ("NaN logits (training forward)", lambda s: _logits(NAN, True, s), LOSS_NAN),
    ("Inf logits (old log-probs)", lambda s: _logits(float("inf"), False, s), OLD_LOGP),
    ("NaN loss", lambda s: _loss(NAN, s), LOSS_NAN),
    ("Inf gradient", lambda s: _gradient(float("inf"), s), GRAD_INF),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_non_finite_stops_the_update_before_commit(
    case: tuple[str, Inject, str], prompts: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    name, inject, message = case
    root, tp = prompts
    run_id = "nf-" + "".join(ch for ch in name.lower() if ch.isalnum())
    ctx = RunContext(run_id=run_id, store_url=str(root))
    real_update = rl_flow.ppo_update

    def update(ctx: RunContext, cfg: VerlFlowConfig, r: str, w: str, it: int) -> Any:
        if it != 1:
            return real_update(ctx, cfg, r, w, it)
        with inject(session_of(ctx)):  # the session the loop bound
            return real_update(ctx, cfg, r, w, it)

    monkeypatch.setattr(rl_flow, "ppo_update", update)
    with pytest.raises(NonFiniteError, match=message):
        rl_loop(ctx, CFG, tp, None)
    store = ctx.store()
    assert store.committed(run_id, "iter-0001/update") is None
    assert list_checkpoints(store, run_id) == [1]
    ckpt = store.committed(run_id, "ckpt/iter-0001")
    assert ckpt is not None
    before = {f.name: f.sha256 for f in ckpt.files}
    assert store.committed(run_id, "iter-0000/update") is not None  # published with ckpt 1
    # the previous checkpoint loads: a fresh session resumes from it at iteration 1
    session = open_session(ctx, CFG, tp, None)
    try:
        assert session.version == 1
        weights = dict(session.lm.named_parameters())
        assert all(torch.isfinite(p).all() for p in weights.values())
    finally:
        session.close()
    after = store.committed(run_id, "ckpt/iter-0001")
    assert after is not None and {f.name: f.sha256 for f in after.files} == before
