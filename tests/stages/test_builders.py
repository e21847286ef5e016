"""The floor's config → verl_core builders: one engine-kwargs builder per registered rollout engine,
the PPO spec of an iteration (the schema's defaults, fields by name), the optimizer specs, the update
seed."""

from __future__ import annotations

import typing

import pytest

from stages.floor.engines import ENGINE_KWARGS, engine_kwargs, vllm_spec
from stages.floor.scorers import SCORER_BUILDERS, build_scorers
from stages.floor.specs import actor_spec, critic_spec, optim_spec, ppo_spec, update_seed
from verl_core.config import RewardConfig, RewardScorerConfig, SandboxConfig, load_config
from verl_core.errors import ConfigError
from verl_core.registry import UnknownNameError
from verl_core.reward import CodeScorer
from verl_core.rollout import ENGINES
from verl_core.rollout.vllm_spec import VLLMSpec
from verl_core.runtime import sandbox
from verl_core.runtime.sandbox import SandboxUnavailableError
from verl_core.seeding import derive_seed


def test_an_engine_the_floor_cannot_build_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # an engine a user's code registers after import has no kwargs builder: a config error naming it
    # and the engines the stages build, not a KeyError of a function object
    monkeypatch.setattr(ENGINES, "_entries", {**ENGINES._entries, "mine": lambda **kw: None})
    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match=r"rollout.name='mine': .* \(it builds auto, hf, vllm\)"):
        engine_kwargs(cfg, "mine")
    with pytest.raises(UnknownNameError, match="Valid names"):  # not registered at all
        engine_kwargs(cfg, "nope")


def test_every_rollout_engine_has_its_kwargs_builder() -> None:
    # keyed by the engine registry's own entries: every factory has its builder, no name is restated
    assert set(ENGINE_KWARGS) == {ENGINES.get(name) for name in ENGINES}
    cfg = load_config(None, ["rollout.max_batch_size=17", "rollout.gpu_memory_utilization=0.3"])
    hf = {"max_batch_size": 17, "share_weights": True, "decode": "auto", "compute_dtype": "float32"}
    assert engine_kwargs(cfg) == hf
    vllm = load_config(
        None,
        [
            "rollout.name=vllm", "rollout.tensor_parallel_size=2", "rollout.kv_cache_gib=2.0",
            "rollout.gpu_memory_utilization=0.3",
        ],
    )  # fmt: skip
    assert engine_kwargs(vllm) == {
        "spec": VLLMSpec(
            dtype="float32",  # the trainer's (model.dtype), not vLLM's auto
            trust_remote_code=False,
            tensor_parallel_size=2,
            gpu_memory_utilization=0.3,
            kv_cache_gib=2.0,
            cpu_kv_cache_gib=1.0,
            enforce_eager=False,
            max_model_len=None,
            weight_sync_bucket_mb=512,
        ),
        "vllm_python": "auto",
    }


def test_rollouts_run_in_the_policys_compute_dtype() -> None:
    """fp32 master weights with bf16 compute: both engines get bfloat16 (vLLM used to get model.dtype,
    float32: its flash/flashinfer backends refuse it and the weights and KV cache take twice the memory)."""
    mixed = ["model.dtype=float32", "actor.mixed_precision.param_dtype=bfloat16"]
    auto = engine_kwargs(load_config(None, ["rollout.name=auto", *mixed]))
    assert auto["vllm"]["spec"].dtype == "bfloat16" and auto["hf"]["compute_dtype"] == "bfloat16"
    assert vllm_spec(load_config(None, [])).dtype == "float32"  # no mixed precision: the weights' dtype


def test_ppo_spec_of_an_iteration() -> None:
    cfg = load_config(
        None,
        [
            "actor.policy_loss=gspo",
            "actor.clip_ratio=0.3",
            "actor.clip_ratio_high=0.28",
            "actor.use_dynamic_bsz=false",
            "actor.ppo_micro_batch_size_per_gpu=3",
            "trainer.critic_warmup=2",
            "rollout.temperature=0",
            "data.max_response_length=99",
        ],
    )
    spec = ppo_spec(cfg, 1)
    # GSPO with loss_agg_mode unset: seq-mean-token-mean (verl's choice for GSPO)
    assert spec.actor.loss_agg_mode == "seq-mean-token-mean"
    # clip_ratio_low unset → clip_ratio; clip_ratio_high given
    assert (spec.actor.clip_ratio_low, spec.actor.clip_ratio_high) == (0.3, 0.28)
    # greedy rollouts (temperature 0) score log-probs at temperature 1
    assert spec.actor.temperature == 1.0
    assert spec.micro_batch_size == 3 and spec.horizon == 99.0
    assert not spec.update_actor and ppo_spec(cfg, 2).update_actor  # critic warm-up: iterations 0, 1
    explicit = load_config(None, ["actor.policy_loss=gspo", "actor.loss_agg_mode=token-mean"])
    assert ppo_spec(explicit, 0).actor.loss_agg_mode == "token-mean"
    assert ppo_spec(load_config(None, []), 0).micro_batch_size is None  # token budgets by default


def test_ppo_spec_takes_the_schema_defaults_and_fields_by_name() -> None:
    default = ppo_spec(load_config(None, []), 0)
    # the schema's budgets: actor/critic micro-batches 4096 tokens, log-prob and reference forwards 8192
    budgets = (default.actor_token_budget, default.critic_token_budget)
    assert (*budgets, default.log_prob_token_budget, default.ref_token_budget) == (4096, 4096, 8192, 8192)
    assert not default.rollout_correction.enabled
    cfg = load_config(
        None,
        [
            "algorithm.gamma=0.9",
            "algorithm.lam=0.8",
            "actor.kl_loss_coef=0.05",
            "actor.entropy_coeff=0.01",
            "algorithm.rollout_correction.log_prob_diff_threshold=0.3",
        ],
    )
    spec = ppo_spec(cfg, 0)
    assert (spec.gamma, spec.lam, spec.actor.kl_loss_coef, spec.actor.entropy_coeff) == (0.9, 0.8, 0.05, 0.01)
    assert spec.rollout_correction.log_prob_diff_threshold == 0.3


def test_optimizer_specs_by_hand() -> None:
    cfg = load_config(
        None,
        [
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_epochs=2",
            "actor.warmup_steps_ratio=0.1",
            "critic.ppo_mini_batch_size=4",
        ],
    )
    # actor: 5 iterations × 2 epochs × 8/2 mini-batches = 40 steps, warm-up int(0.1 · 40) = 4
    actor = actor_spec(cfg, 5)
    assert (actor.total_steps, actor.warmup_steps, actor.scheduler) == (40, 4, cfg.actor.lr_scheduler)
    # critic: 5 × 1 epoch × 8/4 = 10 steps, constant LR, no warm-up
    critic = critic_spec(cfg, 5)
    assert (critic.total_steps, critic.warmup_steps, critic.scheduler) == (10, 0, "constant")
    # warm-up rounds down: int(0.05 · 30) = int(1.5) = 1
    spec = optim_spec(
        lr=1e-3, weight_decay=0.0, grad_clip=1.0, total_steps=30, warmup_ratio=0.05, scheduler="cosine"
    )
    assert spec.warmup_steps == 1 and spec.total_steps == 30


def test_update_seed_is_one_stream_per_iteration() -> None:
    cfg = load_config(None, ["trainer.seed=2"])
    assert update_seed(cfg, 0) == derive_seed("ppo_update", 2, 0)
    # the old mixer (seed + iteration) gave seed 2 / iteration 0 the stream of seed 1 / iteration 1
    assert update_seed(cfg, 0) != update_seed(load_config(None, ["trainer.seed=1"]), 1)


def test_every_scorer_name_has_a_builder() -> None:
    names = typing.get_args(RewardScorerConfig.model_fields["name"].annotation)
    assert sorted(SCORER_BUILDERS.names()) == sorted(names)


def test_code_scorer_without_bwrap_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "bwrap_problem", lambda: "bwrap (bubblewrap) is not installed")
    reward = RewardConfig(scorers=[RewardScorerConfig(name="code")])
    with pytest.raises(SandboxUnavailableError, match="apt-get install -y bubblewrap"):
        build_scorers(reward, SandboxConfig())
    (weak,) = build_scorers(reward, SandboxConfig(allow_weak_sandbox=True, timeout_s=2.0))
    assert isinstance(weak.scorer, CodeScorer) and weak.scorer.spec.backend == "weak"
    assert weak.scorer.spec.timeout_s == 2.0
