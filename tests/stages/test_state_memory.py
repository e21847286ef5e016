"""What the RL session holds in memory (stages/floor/opening.py): under LoRA the reference is the policy
itself with its adapters disabled, so the base weights exist once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.stages.conftest import TINY_RL, opened
from verl_core.config import with_overrides
from verl_core.runtime.run import RunContext
from verl_core.training.ppo_kernels import AdapterDisabledPolicy, make_ppo_batch, response_log_probs


@pytest.fixture
def ctx(tiny_rl: tuple[Path, str], request: pytest.FixtureRequest) -> Iterator[RunContext]:
    yield RunContext(run_id=request.node.name, store_url=str(tiny_rl[0]))


def test_lora_reference_is_the_policy_with_its_adapters_off(
    ctx: RunContext, tiny_rl: tuple[Path, str]
) -> None:
    cfg = with_overrides(
        TINY_RL, ["actor.use_kl_loss=true", "model.lora_rank=4", "algorithm.adv_estimator=grpo"]
    )
    with opened(ctx, cfg, tiny_rl[1], None) as state:
        assert isinstance(state.ref, AdapterDisabledPolicy)
        assert state.ref.actor is state.actor and state.ref.peft_model is state.lm  # no second model
        batch = make_ppo_batch([[5, 6, 7]], [[8, 9, 10]])
        with torch.no_grad():
            base = response_log_probs(state.actor, batch)[0]  # lora_B starts at 0: the policy is its base
            for name, p in state.lm.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5)  # as a few updates would move the adapters
            ref = response_log_probs(state.ref, batch)[0]
            actor = response_log_probs(state.actor, batch)[0]
        torch.testing.assert_close(ref, base)  # the reference is still the base ...
        assert not torch.allclose(actor, base)  # ... while the policy moved


def test_gradient_checkpointing_reaches_the_critic(ctx: RunContext, tiny_rl: tuple[Path, str]) -> None:
    # model.gradient_checkpointing recomputes the critic's activations too (a 0.5B critic's update
    # holds L·A activations per token without it, the policy's backbone size)
    cfg = with_overrides(TINY_RL, ["critic.enable=true", "model.gradient_checkpointing=true"])
    with opened(ctx, cfg, tiny_rl[1], None) as state:
        assert state.critic is not None and state.critic.model.is_gradient_checkpointing
        assert state.lm.is_gradient_checkpointing


def test_without_the_key_neither_model_recomputes(ctx: RunContext, tiny_rl: tuple[Path, str]) -> None:
    with opened(ctx, with_overrides(TINY_RL, ["critic.enable=true"]), tiny_rl[1], None) as state:
        assert state.critic is not None and not state.critic.model.is_gradient_checkpointing
