"""Fixtures for the RL stage tests: a tiny config (2-layer scratch Qwen2, hidden size 32) and its
template_pack output (arithmetic prompts, the locally trained tokenizer), made once per session."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from stages.floor.opening import open_session
from stages.floor.session import RLSession, bound
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig
from verl_core.runtime.run import RunContext

TINY_RL = VerlFlowConfig.model_validate(
    {
        "data": {
            "arithmetic_train_size": 64,
            "arithmetic_val_size": 8,
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
        "algorithm": {"adv_estimator": "gae"},  # a critic, so its checkpoint is covered too
        "rollout": {"n": 2},
        "trainer": {"total_iterations": 4, "max_ckpt_to_keep": 5, "device": "cpu"},
        "execution": {"task_retries": 0},
        "tracking": {"enabled": False},
    }
)


@pytest.fixture(scope="session")
def tiny_rl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``(store root, template_pack manifest URI)`` of :data:`TINY_RL`, in run ``data`` of the store."""
    root = tmp_path_factory.mktemp("rl-stages")
    ctx = RunContext(run_id="data", store_url=str(root))
    return root, template_pack.fn(ctx, TINY_RL.data, TINY_RL.model, preprocess.fn(ctx, TINY_RL.data))


@contextmanager
def opened(
    ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None
) -> Iterator[RLSession]:
    """``with opened(ctx, cfg, tp, sft) as session:`` the run's RL session, open and bound for the RL
    task shells (as the RL loop binds it), closed after."""
    session = open_session(ctx, cfg, template_pack_uri, sft_uri)
    try:
        with bound(session):
            yield session
    finally:
        session.close()
