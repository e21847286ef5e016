"""Preflight: cross-field problems found at config load, one line each, all of them at once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from verl_core.config import load_config
from verl_core.errors import ConfigError


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (  # dynamic sampling drops groups with zero group-relative advantage: meaningless for GAE
            ["algorithm.adv_estimator=gae", "algorithm.filter_groups.enable=true"],
            "algorithm.filter_groups.enable: drops groups whose samples agree, which only a group-relative "
            "estimator (grpo, rloo, reinforce_plus_plus_baseline) gives no gradient; "
            "algorithm.adv_estimator is 'gae'",
        ),
        (  # GRPO's baseline is the group mean: one sample per prompt has no group
            ["algorithm.adv_estimator=grpo", "rollout.n=1"],
            "rollout.n: 1 sample per prompt gives algorithm.adv_estimator 'grpo' no group baseline; "
            "expected rollout.n >= 2 (or an estimator without groups: gae, reinforce_plus_plus, remax)",
        ),
        (  # the tool-using teacher's demonstrations call the calculator or answer at once: no third style
            ["data.arithmetic_tool_share=0.5", "data.arithmetic_terse_share=0.6"],
            "data.arithmetic_tool_share: 0.5 is a teacher of its own; expected arithmetic_terse_share and "
            "arithmetic_stop_early 0 beside it",
        ),
        (  # arithmetic data of 6 problems cannot fill a batch of 8 prompts
            ["data.arithmetic_train_size=6", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4"],
            "data.train_batch_size: 8 prompts per iteration, but the data holds at most 6",
        ),
        (  # a cap on the cleaned rows bounds any source
            ["data.source=gsm8k", "data.max_train_samples=5"],
            "data.train_batch_size: 8 prompts per iteration, but the data holds at most 5",
        ),
        (  # defaults: 128 prompt + 64 response tokens = 192 per sample
            ["actor.ppo_max_token_len_per_gpu=100"],
            "actor.ppo_max_token_len_per_gpu: 100 tokens cannot hold one full-length sample "
            "(data.max_prompt_length + data.max_response_length = 192); expected >= 192",
        ),
        (
            ["rollout.log_prob_max_token_len_per_gpu=191"],
            "rollout.log_prob_max_token_len_per_gpu: 191 tokens cannot hold one full-length sample "
            "(data.max_prompt_length + data.max_response_length = 192); expected >= 192",
        ),
        (
            ["algorithm.adv_estimator=gae", "critic.ppo_max_token_len_per_gpu=64"],
            "critic.ppo_max_token_len_per_gpu: 64 tokens cannot hold one full-length sample",
        ),
        (
            ["actor.use_kl_loss=true", "ref.log_prob_max_token_len_per_gpu=64"],
            "ref.log_prob_max_token_len_per_gpu: 64 tokens cannot hold one full-length sample",
        ),
        (
            ["sft.max_token_len_per_batch=64"],
            "sft.max_token_len_per_batch: 64 tokens cannot hold one full-length sample",
        ),
        (  # 128 + 64 = 192 positions needed
            ["model.max_position_embeddings=160"],
            "model.max_position_embeddings: 160 is shorter than the longest sequence "
            "(data.max_prompt_length + data.max_response_length = 192)",
        ),
        (
            ["trainer.total_iterations=3", "trainer.critic_warmup=3", "algorithm.adv_estimator=gae"],
            "trainer.critic_warmup: 3 warm-up iterations leave none of the trainer.total_iterations (3) "
            "to update the actor; expected < 3",
        ),
        (  # two processes each training a full copy would not share gradients
            ["trainer.n_gpus_per_node=2"],
            "actor.strategy: 'single' trains one copy per process, but trainer.nnodes × "
            "trainer.n_gpus_per_node = 2 processes: use 'fsdp2' or 'deepspeed'",
        ),
        (
            ["trainer.nnodes=2", "actor.strategy=fsdp2", "rollout.share_weights=false"],
            "trainer.rdzv_endpoint: required (host:port of node 0) when trainer.nnodes is 2",
        ),
        (
            [
                "actor.tensor_parallel_size=2",
                "trainer.n_gpus_per_node=2",
                "actor.strategy=deepspeed",
                "rollout.share_weights=false",
            ],
            "actor.tensor_parallel_size: 2 needs actor.strategy 'fsdp2', got 'deepspeed'",
        ),
        (  # 4 heads, 2 kv heads by default: tp 4 splits no kv head
            [
                "actor.tensor_parallel_size=4",
                "trainer.n_gpus_per_node=4",
                "actor.strategy=fsdp2",
                "rollout.share_weights=false",
            ],
            "actor.tensor_parallel_size: 4 does not divide model.num_attention_heads 4 and "
            "model.num_key_value_heads 2",
        ),
        (
            ["actor.strategy=fsdp2", "model.lora_rank=8", "rollout.share_weights=false"],
            "model.lora_rank: LoRA with actor.strategy 'fsdp2' is not supported yet",
        ),
        (
            ["actor.strategy=fsdp2"],
            "rollout.share_weights: the hf engine cannot generate from the actor's sharded weights",
        ),
        (
            ["actor.strategy=deepspeed", "actor.param_offload=true", "rollout.share_weights=false"],
            "actor.param_offload: needs actor.strategy 'fsdp2', got 'deepspeed'",
        ),
        (
            ["algorithm.rollout_correction.rollout_is=token", "actor.use_rollout_logprobs=true"],
            "algorithm.rollout_correction: rollout_is 'token', rollout_rs None weigh π_old against the "
            "rollout's log-probs, but actor.use_rollout_logprobs=true makes them the same",
        ),
        (  # the ahead rollout samples version i while the update moves the live module to i+1
            ["trainer.rollout_ahead=1"],
            "trainer.rollout_ahead: 1 needs an engine with its own weights: rollout.share_weights=false",
        ),
        (
            [
                "trainer.rollout_ahead=1",
                "trainer.n_gpus_per_node=2",
                "actor.strategy=fsdp2",
                "rollout.share_weights=false",
            ],
            "trainer.rollout_ahead: 1 runs in one process for now, not 2: set it to 0",
        ),
        (
            ["trainer.rollout_ahead=1", "rollout.share_weights=false", "algorithm.filter_groups.enable=true"],
            "trainer.rollout_ahead: 1 does not sample ahead in generation batches yet",
        ),
        (  # fp32 compute from bf16 master weights: no precision gained, the update is stored in bf16
            ["model.dtype=bfloat16", "actor.lr=1e-4", "critic.mixed_precision.param_dtype=float32"],
            "critic.mixed_precision.param_dtype: float32 with model.dtype bfloat16 computes in fp32",
        ),
        (  # the reference of a LoRA actor is the actor itself with its adapters off
            ["model.lora_rank=4", "actor.use_kl_loss=true", "ref.mixed_precision.param_dtype=bfloat16"],
            "ref.mixed_precision.param_dtype: the reference of a LoRA actor without ref.path is the actor",
        ),
        (
            ["model.use_liger=true", "trainer.device=cpu"],
            "model.use_liger: true needs a CUDA device (liger's kernels are Triton), not trainer.device=cpu",
        ),
        (
            ["model.torch_compile=true", "actor.strategy=deepspeed", "rollout.share_weights=false"],
            "model.torch_compile: not tested with actor.strategy deepspeed (ZeRO's parameter hooks",
        ),
        (  # eager attention gets no packed-call keywords: nothing would run compiled
            ["model.torch_compile=true", "model.attn_implementation=eager"],
            "model.torch_compile: compiles the packed forwards of sdpa and flash_attention_2 models",
        ),
    ],
)
def test_each_problem_is_one_line_naming_its_fields(overrides: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(line)
    assert "\n" not in str(info.value)


def test_budgets_of_parts_that_do_not_run_are_not_checked() -> None:
    # no critic (GRPO), no reference (no KL term), no SFT, no reward model: their budgets are unused
    cfg = load_config(
        None,
        [
            "critic.ppo_max_token_len_per_gpu=1",
            "ref.log_prob_max_token_len_per_gpu=1",
            "sft.enable=false",
            "sft.max_token_len_per_batch=1",
            "reward.model_max_tokens_per_batch=1",
        ],
    )
    assert not cfg.use_critic


def test_estimators_without_groups_accept_one_sample() -> None:
    for estimator in ("gae", "reinforce_plus_plus", "remax"):
        assert load_config(None, [f"algorithm.adv_estimator={estimator}", "rollout.n=1"]).rollout.n == 1


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor.ppo_mini_batch_size=3", "rollout.n=1", "actor.ppo_max_token_len_per_gpu=8"])
    lines = str(info.value).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "actor.ppo_mini_batch_size",
        "rollout.n",
        "actor.ppo_max_token_len_per_gpu",
    ]


SCRATCH_LR_WARNING = (
    "actor.lr: 1e-06 with model.init 'scratch' is a pretrained model's learning rate (the default 1e-06 is "
    "verl's for a pretrained 0.5B model) and barely moves a model trained from scratch; the CPU quickstarts "
    "use actor.lr 6e-05 (warned below 1e-05)"
)


def test_a_scratch_model_with_a_pretrained_learning_rate_is_warned_not_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the defaults: model.init 'scratch' meets verl's actor.lr 1e-6 for a pretrained 0.5B model
    cfg = load_config(None)
    assert (cfg.model.init, cfg.actor.lr) == ("scratch", 1e-6)
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [SCRATCH_LR_WARNING]


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["actor.lr=9e-6"], True),  # just below the bound
        (["actor.lr=1e-5"], False),  # at the bound
        (["actor.lr=6e-5"], False),  # the quickstarts'
        (["model.init=pretrained", "model.path=Qwen/Qwen2.5-0.5B-Instruct"], False),  # verl's own case
    ],
)
def test_scratch_learning_rate_bound(
    caplog: pytest.LogCaptureFixture, overrides: list[str], warned: bool
) -> None:
    load_config(None, overrides)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [line.split(":")[0] for line in lines] == (["actor.lr"] if warned else [])


def test_mixed_precision_combinations_that_run() -> None:
    # fp32 master weights + bf16 compute (the mixed case), and pure bf16 (nothing to mix)
    mixed = load_config(None, ["actor.mixed_precision.param_dtype=bfloat16"])
    assert mixed.model.dtype == "float32" and mixed.actor.mixed_precision.param_dtype == "bfloat16"
    assert mixed.critic.mixed_precision.param_dtype is None  # each role its own, as verl
    # (an lr of 1e-4 is above bf16's rounding floor 3.9e-5: test_update_below_bf16_rounding_is_refused)
    pure = load_config(
        None, ["model.dtype=bfloat16", "actor.lr=1e-4", "actor.mixed_precision.param_dtype=bfloat16"]
    )
    assert pure.actor.mixed_precision.reduce_dtype == "float32"


def test_compiling_on_cpu_needs_a_cpp_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(ConfigError, match=r"'no-such-compiler-xyz' \(the CXX environment variable"):
        load_config(None, ["model.torch_compile=true", "trainer.device=cpu"])


# Issue 36 item 7: pure bf16 weights trained by AdamW at lr 1e-6 do not move. The floor is
# u(bf16) × 0.01 = 2^-8 × 0.01 = 0.00390625 × 0.01 ≈ 3.9e-5 (u: bf16's unit roundoff, 8 significant bits;
# 0.01: the small end of pretrained weights); actor.lr 1e-6 and critic.lr 1e-5 are both below it.
GSM8K_PPO = Path(__file__).resolve().parents[3] / "configs" / "gsm8k_ppo.yaml"


def _below_rounding(field: str, lr: str, section: str) -> str:
    return (
        f"{field}: {lr} is below the rounding of model.dtype bfloat16 weights (AdamW moves a weight by ≈ lr "
        "per step; refused below 0.00391 × 0.01 = 3.9e-05), most weights would not change: keep fp32 "
        f"master weights and compute in bf16 (model.dtype=float32 {section}.mixed_precision.param_dtype="
        "bfloat16)"
    )


def test_the_old_gsm8k_ppo_precision_is_refused_and_the_shipped_one_accepted(tmp_path: Path) -> None:
    old = yaml.safe_load(GSM8K_PPO.read_text())
    old["model"]["dtype"] = "bfloat16"  # as shipped before: pure bf16, no mixed precision
    for section in ("actor", "critic", "ref"):
        old[section].pop("mixed_precision", None)
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "old.yaml")
    assert str(info.value).splitlines() == [
        _below_rounding("actor.lr", "1e-06", "actor"),
        _below_rounding("critic.lr", "1e-05", "critic"),
    ]
    cfg = load_config(GSM8K_PPO)  # fp32 masters, bf16 compute for every role
    assert cfg.model.dtype == "float32"
    roles = (cfg.actor, cfg.critic, cfg.ref)
    assert [r.mixed_precision.param_dtype for r in roles] == ["bfloat16"] * 3


@pytest.mark.parametrize(
    ("overrides", "refused"),
    [
        (["model.dtype=bfloat16", "actor.lr=3.8e-5"], ["actor.lr"]),  # just below 3.9e-5
        (["model.dtype=bfloat16", "actor.lr=4e-5"], []),  # just above
        (["model.dtype=bfloat16", "actor.lr=1e-4", "sft.lr=1e-5"], ["sft.lr"]),  # SFT trains the actor
        (["model.dtype=bfloat16", "actor.lr=1e-4", "sft.enable=false", "sft.lr=1e-5"], []),
        # LoRA: PEFT keeps the adapters (the trained weights) in fp32 over a bf16 base; the critic is full
        (["model.dtype=bfloat16", "model.lora_rank=8"], []),
        (["model.dtype=bfloat16", "model.lora_rank=8", "algorithm.adv_estimator=gae"], ["critic.lr"]),
        (["model.dtype=float32", "actor.lr=1e-9"], []),  # fp32: floor 2^-24 × 0.01 ≈ 6e-10
    ],
)
def test_update_below_bf16_rounding_is_refused(overrides: list[str], refused: list[str]) -> None:
    try:
        load_config(None, overrides)
        lines: list[str] = []
    except ConfigError as e:
        lines = str(e).splitlines()
    assert [line.split(":")[0] for line in lines] == refused
