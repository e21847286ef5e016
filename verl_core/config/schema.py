"""The schema of a verl-flow run: sections, defaults, one-line descriptions, cross-field checks.

Every default lives here and nowhere else; every field carries a one-line description (shown by
``verl-flow config show`` and rendered by the Prefect UI as the flow's parameters). Section and field
names follow verl where verl has one (``data.train_batch_size``, ``actor.ppo_mini_batch_size``,
``algorithm.adv_estimator``, ``rollout.n`` ...). The defaults are the embedded quickstart: a tiny
model built from scratch on CPU, synthetic arithmetic data, a local artifact store and local MLflow.

Names of algorithm variants (advantage estimators, policy losses, KL estimators and controllers, loss
aggregation modes) are the ``Literal`` types of :mod:`verl_core.algorithms`, defined next to their
registries, so the config accepts exactly the registered names.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from verl_core.algorithms import (
    AdvEstimatorName,
    KLControllerName,
    KLEstimatorName,
    LossAggMode,
    PolicyLossName,
    RolloutISLevel,
    RolloutRSLevel,
)

# The config's names for them (kept: other code imports these from verl_core.config).
AdvEstimator = AdvEstimatorName
PolicyLoss = PolicyLossName
KLEstimator = KLEstimatorName

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Prob = Annotated[float, Field(ge=0, le=1)]


Strategy = Literal["single", "fsdp2", "deepspeed"]


def _f(default: Any, description: str, **kw: Any) -> Any:
    """A field with its default and its one-line description."""
    return Field(default, description=description, **kw)


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class DataConfig(Section):
    source: Literal["gsm8k", "arithmetic", "jsonl", "parquet", "hf"] = _f(
        "arithmetic", "Dataset adapter: built-in gsm8k / synthetic arithmetic, or any jsonl/parquet/hf data"
    )
    train_files: list[str] = _f([], "Training data files or an HF dataset id (empty: the adapter's default)")
    val_files: list[str] = _f([], "Held-out data files or HF id (empty: the adapter's default split)")
    max_train_samples: NonNegInt = _f(0, "Keep at most this many training rows after cleaning (0: all)")
    max_val_samples: NonNegInt = _f(0, "Keep at most this many held-out rows after cleaning (0: all)")
    strict: bool = _f(False, "Fail on the first bad row (naming file and line) instead of dropping it")
    prompt_key: str = _f("question", "Field holding the prompt text (jsonl/parquet/hf)")
    messages_key: str | None = _f(
        None, "Field holding chat messages instead of prompt_key (jsonl/parquet/hf)"
    )
    answer_key: str = _f("answer", "Field holding the reference answer or solution (jsonl/parquet/hf)")
    ground_truth_regex: str | None = _f(
        None, "Regex whose group 1 extracts the ground truth from the answer (None: the whole answer)"
    )
    data_source: str | None = _f(None, "data_source written into the rows (None: the file stem or HF id)")
    ability: str = _f("math", "ability written into the rows (jsonl/parquet/hf)")
    instruction: str = _f("", "Text appended to every prompt after a space (jsonl/parquet/hf)")
    hf_name: str | None = _f(None, "HF dataset configuration name (source=hf; gsm8k uses 'main')")
    hf_train_split: str = _f("train", "HF split read for training")
    hf_val_split: str | None = _f("test", "HF split read as held-out set (None: hold out from train)")
    val_holdout_rows: NonNegInt = _f(
        100, "Rows held out from train as validation when the source has no held-out split (0: none)"
    )
    arithmetic_train_size: PositiveInt = _f(2000, "Synthetic arithmetic: training problems")
    arithmetic_val_size: PositiveInt = _f(100, "Synthetic arithmetic: held-out problems")
    arithmetic_digits: int = _f(2, "Synthetic arithmetic: digits of the +/- operands", ge=1, le=6)
    arithmetic_steps: int = _f(2, "Synthetic arithmetic: operations per problem", ge=1, le=8)
    arithmetic_stop_early: Prob = _f(
        0.0,
        "Synthetic arithmetic: probability that a training demonstration stops one operation short and "
        "reports the value before it (an incomplete SFT teacher; ground truths and held-out solutions "
        "stay exact)",
    )
    arithmetic_tool_share: Prob = _f(
        0.0,
        "Synthetic arithmetic: share of training demonstrations that call the calculator tool and copy "
        "its result (multi-turn SFT rows); the rest answer at once (0: worked solutions, no tool)",
    )
    arithmetic_terse_share: Prob = _f(
        0.0,
        "Synthetic arithmetic: share of training demonstrations that give the exact answer at once "
        "(#### N) instead of the worked solution (a teacher of two styles, both correct; held-out "
        "solutions follow the same mix)",
    )
    arithmetic_ops: list[Literal["+", "-", "*"]] = _f(
        ["+", "-"], "Synthetic arithmetic: operators drawn from (the * operand has one digit)", min_length=1
    )
    train_batch_size: PositiveInt = _f(8, "Prompts per RL iteration (each sampled rollout.n times)")
    max_prompt_length: PositiveInt = _f(128, "Longest prompt in tokens (see truncation)")
    max_response_length: PositiveInt = _f(64, "Longest response in tokens (generation and SFT targets)")
    truncation: Literal["error", "left", "right", "drop"] = _f(
        "error", "What to do with a prompt/response over its length limit"
    )
    chat_template: Literal["auto", "chatml", "llama3", "plain", "hermes"] = _f(
        "auto", "Chat template: the tokenizer's own (auto; chatml if it has none) or a named built-in"
    )
    tokenizer_train_rows: NonNegInt = _f(
        2000,
        "model.init=scratch: train the tokenizer on at most this many training rows, evenly spaced (0: all)",
    )
    pack_token_budget: PositiveInt = _f(
        4096, "Tokens per bin of the SFT packing plan (>= max_prompt_length + max_response_length)"
    )
    pack_algorithm: Literal["ffd", "bfd"] = _f("bfd", "Bin packing: first-fit or best-fit decreasing")
    shuffle: bool = _f(True, "Shuffle the prompt set every epoch")
    seed: int = _f(1, "Seed for data generation, splitting and shuffling")
    snapshot_prefix: str | None = _f(
        None,
        "Directory of dated snapshots (YYYY-MM-DD/...): train_files/val_files are read from the newest one",
    )

    @field_validator("ground_truth_regex")
    @classmethod
    def _regex_compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"a valid regular expression ({e})") from None
        return v

    @model_validator(mode="after")
    def _lengths_fit_budget(self) -> DataConfig:
        if self.pack_token_budget < self.max_prompt_length + self.max_response_length:
            raise ValueError(
                f"data.pack_token_budget: {self.pack_token_budget} must be >= data.max_prompt_length + "
                f"data.max_response_length ({self.max_prompt_length + self.max_response_length})"
            )
        return self


class QuantizationConfig(Section):
    bits: Literal[4, 8] = _f(4, "Weight bits for bitsandbytes quantization (QLoRA uses 4)")
    quant_type: Literal["nf4", "fp4"] = _f("nf4", "4-bit data type")
    double_quant: bool = _f(True, "Quantize the quantization constants too")
    compute_dtype: Literal["float32", "bfloat16", "float16"] = _f("bfloat16", "Dtype of the matmuls")


class MixedPrecisionConfig(Section):
    """verl's ``fsdp_config.mixed_precision``: compute in ``param_dtype`` from master weights kept in
    ``model.dtype`` (:mod:`verl_core.training.precision`)."""

    param_dtype: Literal["float32", "bfloat16"] | None = _f(
        None, "Forward/backward compute dtype; master weights and optimizer stay model.dtype (None: off)"
    )
    reduce_dtype: Literal["float32", "bfloat16"] = _f(
        "float32", "Dtype of the cross-rank gradient reduction (fsdp2, deepspeed)"
    )
    buffer_dtype: Literal["float32", "bfloat16"] = _f(
        "float32", "Floating buffers (e.g. RoPE inv_freq) are cast to this when param_dtype is set"
    )


class ModelConfig(Section):
    path: str | None = _f(None, "HF hub id or local directory of the base model (None: build from scratch)")
    init: Literal["pretrained", "scratch"] = _f(
        "scratch", "Load pretrained weights from path, or build a tiny model from the sizes below"
    )
    architecture: Literal["qwen2", "llama"] = _f("qwen2", "Architecture for init=scratch")
    hidden_size: PositiveInt = _f(128, "Hidden size for init=scratch")
    num_hidden_layers: PositiveInt = _f(2, "Decoder layers for init=scratch")
    num_attention_heads: PositiveInt = _f(4, "Attention heads for init=scratch")
    num_key_value_heads: PositiveInt = _f(2, "Key/value heads (GQA) for init=scratch")
    intermediate_size: PositiveInt = _f(256, "MLP width for init=scratch")
    vocab_size: PositiveInt = _f(512, "Tokenizer vocabulary trained on the run's text for init=scratch")
    max_position_embeddings: PositiveInt = _f(1024, "Longest sequence the model supports (init=scratch)")
    trust_remote_code: bool = _f(
        False, "Allow code from the model repository to run (off unless you trust it)"
    )
    dtype: Literal["float32", "bfloat16"] = _f("float32", "Parameter dtype")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = _f(
        "sdpa", "Attention kernel (flash_attention_2 needs flash-attn on a GPU)"
    )
    packed_attention: Literal["auto", "flash_attn", "varlen", "flex", "bucketed", "padded"] = _f(
        "auto",
        "Attention backend of packed training/log-prob/score forwards when attn_implementation=sdpa "
        "(attn_implementation governs generation); auto: best that passes its self-check on the device",
    )
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory")
    use_liger: bool = _f(
        False,
        "Liger's fused RMSNorm/RoPE/SwiGLU kernels (qwen2, llama; CUDA; pip install 'verl-flow[liger]')",
    )
    torch_compile: bool = _f(
        False,
        "torch.compile each decoder layer for packed training/log-prob/critic forwards (generation "
        "stays eager); the first forward compiles (CPU: needs a C++ compiler; measured slower on CPU at "
        "the quickstart's size)",
    )
    share_prompts: bool = _f(
        True,
        "PPO/GRPO forwards (old/reference log-probs, values, actor and critic updates) store the prompt "
        "of a micro-batch's samples of one prompt group once: exact under causal attention (equal to "
        "float rounding; with dropout the samples share the prompt's dropout mask); packed attention "
        "(attn_implementation sdpa) only, others compute every sample",
    )
    lora_rank: NonNegInt = _f(0, "LoRA rank (0: full fine-tuning)")
    lora_alpha: PositiveInt = _f(16, "LoRA scaling numerator")
    lora_dropout: Prob = _f(0.0, "Dropout on the LoRA branch")
    target_modules: list[str] | Literal["all-linear"] = _f("all-linear", "Modules that get LoRA adapters")
    quantization: QuantizationConfig | None = _f(None, "bitsandbytes quantization of the base (QLoRA)")


class SFTConfig(Section):
    enable: bool = _f(True, "Run the SFT warm-up stage before RL")
    epochs: PositiveInt = _f(2, "Passes over the SFT data")
    max_steps: NonNegInt = _f(0, "Stop after this many optimizer steps (0: no limit)")
    lr: PositiveFloat = _f(3e-3, "Peak learning rate")
    weight_decay: NonNegFloat = _f(0.0, "AdamW weight decay")
    warmup_ratio: Prob = _f(0.05, "Fraction of steps spent in linear warm-up")
    lr_scheduler: Literal["constant", "cosine"] = _f("cosine", "Schedule after warm-up")
    grad_clip: PositiveFloat = _f(1.0, "Clip the global gradient norm to this")
    batch_size: PositiveInt = _f(32, "Sequences per optimizer step")
    max_token_len_per_batch: PositiveInt = _f(4096, "Token budget of one packed micro-batch")
    val_every: NonNegInt = _f(50, "Validation loss every this many steps (0: end of each epoch only)")
    save_every: NonNegInt = _f(50, "Checkpoint weights + trainer state every this many steps (0: at the end)")
    log_every: PositiveInt = _f(10, "Log training metrics every this many steps")


class ActorConfig(Section):
    strategy: Strategy = _f(
        "single",
        "Training engine: single (one process), fsdp2 (fully_shard per decoder layer) or deepspeed (ZeRO "
        "actor.zero_stage); fsdp2/deepspeed shard over the trainer.nnodes × trainer.n_gpus_per_node ranks",
    )
    param_offload: bool = _f(False, "fsdp2: keep sharded parameters, grads and optimizer state on the CPU")
    tensor_parallel_size: PositiveInt = _f(
        1, "fsdp2: tensor-parallel degree of the attention/MLP projections (a 2-D data × tensor mesh)"
    )
    mixed_precision: MixedPrecisionConfig = _f(
        MixedPrecisionConfig(),
        "bf16 compute with fp32 master weights (the actor's update, old log-probs, SFT)",
    )
    lr: PositiveFloat = _f(1e-6, "Actor learning rate")
    weight_decay: NonNegFloat = _f(0.01, "AdamW weight decay")
    warmup_steps_ratio: Prob = _f(0.0, "Fraction of updates in linear warm-up")
    lr_scheduler: Literal["constant", "cosine"] = _f("constant", "Schedule after warm-up")
    grad_clip: PositiveFloat = _f(1.0, "Clip the global gradient norm to this")
    ppo_epochs: PositiveInt = _f(1, "Passes over each iteration's rollouts")
    ppo_mini_batch_size: PositiveInt = _f(4, "Prompts per optimizer step (times rollout.n samples)")
    use_dynamic_bsz: bool = _f(True, "Token-budget micro-batches instead of a fixed count")
    ppo_micro_batch_size_per_gpu: PositiveInt = _f(8, "Samples per micro-batch when use_dynamic_bsz=false")
    ppo_max_token_len_per_gpu: PositiveInt = _f(4096, "Token budget of one micro-batch")
    policy_loss: PolicyLoss = _f("vanilla", "Policy loss (PPO clip or GSPO)")
    clip_ratio: NonNegFloat = _f(0.2, "PPO clip range ε (both sides unless low/high are set)")
    clip_ratio_low: NonNegFloat | None = _f(None, "Lower clip ε (None: clip_ratio)")
    clip_ratio_high: NonNegFloat | None = _f(None, "Upper clip ε, clip-higher (None: clip_ratio)")
    clip_ratio_c: float = _f(3.0, "Dual-clip bound c > 1 applied where the advantage is negative", gt=1.0)
    loss_agg_mode: LossAggMode | None = _f(
        None,
        "How token losses (policy, entropy, KL) become one number (None: token-mean, or "
        "seq-mean-token-mean under policy_loss=gspo, as verl)",
    )
    entropy_coeff: NonNegFloat = _f(0.0, "Entropy bonus coefficient")
    use_kl_loss: bool = _f(False, "Add a KL(actor || ref) loss term (GRPO style)")
    kl_loss_coef: NonNegFloat = _f(0.001, "Coefficient of the KL loss")
    kl_loss_type: KLEstimator = _f("low_var_kl", "KL estimator of the loss term")
    use_rollout_logprobs: bool = _f(False, "Use the rollout engine's log-probs as old log-probs")
    zero_stage: Literal[1, 2, 3] = _f(2, "DeepSpeed ZeRO stage (strategy=deepspeed)")

    @property
    def resolved_loss_agg_mode(self) -> LossAggMode:
        """``loss_agg_mode`` if given, else verl's choice: seq-mean-token-mean for GSPO (a sequence-level
        ratio, averaged per sequence), token-mean otherwise."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq-mean-token-mean" if self.policy_loss == "gspo" else "token-mean"


class CriticConfig(Section):
    enable: bool | None = _f(None, "Train a critic (None: only when algorithm.adv_estimator=gae)")
    strategy: Strategy = _f("single", "Training engine of the critic (see actor.strategy)")
    zero_stage: Literal[1, 2, 3] = _f(2, "DeepSpeed ZeRO stage (strategy=deepspeed)")
    param_offload: bool = _f(False, "fsdp2: keep sharded parameters, grads and optimizer state on the CPU")
    mixed_precision: MixedPrecisionConfig = _f(MixedPrecisionConfig(), "bf16 compute of the critic")
    path: str | None = _f(None, "Critic init: None to start from the policy's backbone, or a model path")
    lr: PositiveFloat = _f(1e-5, "Critic learning rate")
    weight_decay: NonNegFloat = _f(0.01, "AdamW weight decay")
    grad_clip: PositiveFloat = _f(1.0, "Clip the global gradient norm to this")
    ppo_epochs: PositiveInt = _f(1, "Passes over each iteration's rollouts")
    ppo_mini_batch_size: PositiveInt = _f(4, "Prompts per critic optimizer step")
    ppo_max_token_len_per_gpu: PositiveInt = _f(4096, "Token budget of one micro-batch")
    cliprange_value: NonNegFloat = _f(0.5, "Value clip range around the old values")
    loss_agg_mode: LossAggMode = _f("token-mean", "How token value losses become one number")


class RefConfig(Section):
    path: str | None = _f(
        None,
        "A reference policy other than the starting policy (HF id or local dir); None: the SFT/start "
        "policy (for LoRA, the base without adapters)",
    )
    log_prob_max_token_len_per_gpu: PositiveInt = _f(8192, "Token budget of one reference forward")
    strategy: Literal["single", "fsdp2"] = _f(
        "single", "How the frozen reference is placed: single (a full copy per rank) or fsdp2 (sharded)"
    )
    param_offload: bool = _f(False, "fsdp2: keep the sharded reference parameters on the CPU")
    mixed_precision: MixedPrecisionConfig = _f(
        MixedPrecisionConfig(), "bf16 compute of the reference's forwards (a LoRA ref follows the actor)"
    )


class MultiTurnConfig(Section):
    """Multi-turn rollouts with tools (verl_core.rollout.multi_turn): the model calls tools in the
    ``<tool_call>`` format of the ``hermes`` template, tool results are appended as tool turns (masked
    out of the loss), and the loop goes on until the model answers without a tool call or a budget ends."""

    enable: bool = _f(False, "Roll out multi-turn with tools (training, validation and eval rollouts)")
    max_turns: PositiveInt = _f(4, "Model turns per response (a tool call in the last one is not run)")
    max_tool_calls: PositiveInt = _f(
        4, "Tool calls run per response; further calls are answered with an error"
    )
    max_tokens_per_turn: PositiveInt = _f(256, "New tokens of one model turn")
    tools: list[str] = _f(
        ["calculator"],
        "Tools: built-in names (calculator) or 'package.module:function' with a 'schema' attribute",
    )
    format: Literal["hermes"] = _f(
        "hermes", 'Tool-call format: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen2.5)'
    )
    tool_workers: PositiveInt = _f(4, "Threads running the tool calls of one turn (all samples) in parallel")


class RolloutConfig(Section):
    name: Literal["hf", "vllm", "auto"] = _f(
        "hf",
        "Generation engine: hf (transformers, colocated), vllm (its own environment), or auto: the faster "
        "one measured on the device (verl_core.rollout.registry.AUTO_ENGINE: hf on CPU, vllm on CUDA)",
    )
    n: PositiveInt = _f(4, "Samples per prompt")
    temperature: NonNegFloat = _f(1.0, "Sampling temperature (0: greedy)")
    top_p: float = _f(1.0, "Nucleus sampling mass", gt=0, le=1)
    top_k: int = _f(-1, "Top-k sampling (-1: off)", ge=-1)
    stop: list[str] = _f([], "Extra stop strings")
    seed: int = _f(1, "Sampling seed")
    tensor_parallel_size: PositiveInt = _f(1, "vLLM tensor parallel size")
    share_weights: bool = _f(
        True,
        "hf engine: sample from the trainer's live module (true) or from its own copy that receives the new "
        "weights after every update (false, as vLLM always does)",
    )
    gpu_memory_utilization: float = _f(
        0.5, "vLLM share of accelerator memory (weights + KV cache) when kv_cache_gib is None", gt=0, le=1
    )
    kv_cache_gib: PositiveFloat | None = _f(
        None, "vLLM KV cache in GiB (None: gpu_memory_utilization on an accelerator, cpu_kv_cache_gib on CPU)"
    )
    cpu_kv_cache_gib: PositiveFloat = _f(
        1.0,
        "vLLM KV cache in GiB on its CPU platform, where gpu_memory_utilization would be a share of the "
        "machine's RAM (vLLM's 0.92 fails beside other processes)",
    )
    vllm_enforce_eager: bool = _f(
        False, "vLLM: no torch.compile / CUDA graphs (engine start ~35 s instead of ~55 s on a 2-core CPU)"
    )
    vllm_python: str = _f(
        "auto",
        "Python of the vLLM environment, used when vllm does not import in the stage's process (auto: "
        "$VERL_FLOW_VLLM_PYTHON, else .venv-vllm/bin/python built by `make .venv-vllm`)",
    )
    weight_sync_bucket_mb: PositiveInt = _f(
        512, "vLLM weight sync: tensors are staged in files of at most this many MiB (the trainer's extra)"
    )
    log_prob_max_token_len_per_gpu: PositiveInt = _f(8192, "Token budget of one log-prob forward")
    max_batch_size: PositiveInt = _f(256, "HF engine: most sequences generated in one batch")
    decode: Literal["auto", "loop", "compiled", "generate"] = _f(
        "auto",
        "HF engine decoding: own eager loop, compiled CUDA-graph step, or transformers generate (the "
        "reference); auto: compiled on CUDA, loop elsewhere",
    )
    val_temperature: NonNegFloat = _f(0.0, "Temperature for validation (0: greedy)")
    val_n: PositiveInt = _f(1, "Samples per prompt in validation")
    multi_turn: MultiTurnConfig = _f(
        MultiTurnConfig(),
        "Multi-turn tool use; data.max_response_length then bounds all turns together, model and tool tokens",
    )


class RewardScorerConfig(Section):
    name: Literal["rule", "function", "model", "remote", "judge", "code"] = _f(
        "rule",
        "Scorer: data_source rules, reward.function, the reward model, reward.remote, reward.judge, or "
        "code run against the row's tests in the sandbox",
    )
    weight: float = _f(1.0, "Weight of this scorer in the total score (components hold weight x score)")


JUDGE_TEMPLATE = (
    "Grade the answer to the question against the reference answer.\n\n"
    "Question:\n{prompt}\n\nReference answer:\n{ground_truth}\n\nAnswer to grade:\n{response}\n\n"
    "Give a score from 0 (wrong) to 10 (fully correct). End with one line 'Score: N'."
)
_TEMPLATE_FIELDS = {"prompt", "response", "ground_truth"}


class HttpEndpointConfig(Section):
    """What the remote and judge scorers share: auth, timeouts, retries, concurrency (one client,
    verl_core.reward.http)."""

    token_env: str | None = _f(
        None, "Name of the environment variable holding the bearer token (None: no Authorization header)"
    )
    connect_timeout_s: PositiveFloat = _f(5.0, "Seconds to open a connection")
    read_timeout_s: PositiveFloat = _f(60.0, "Seconds to wait for each read of the answer")
    max_retries: NonNegInt = _f(
        3, "Retries of one request on connection errors, timeouts, 429 and 5xx (never on other 4xx)"
    )
    backoff_s: PositiveFloat = _f(0.5, "First retry waits up to this long (full jitter), doubling each retry")
    max_backoff_s: PositiveFloat = _f(30.0, "Cap of one retry wait (also of a server's Retry-After)")
    max_concurrency: PositiveInt = _f(4, "Requests in flight at once")

    @field_validator("token_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            # the message never repeats the value: it may be a token pasted by mistake
            raise ValueError(
                f"the name of an environment variable (e.g. RM_TOKEN), not a value ({len(v)} chars)"
            )
        return v


def _http_url(v: str | None) -> str | None:
    if v is not None and not v.startswith(("http://", "https://")):
        raise ValueError(f"{v!r} is not an http:// or https:// URL")
    return v


class RemoteRewardConfig(HttpEndpointConfig):
    """An HTTP(S) endpoint scoring batches (scorer 'remote'; wire format in verl_core.reward.remote)."""

    url: str | None = _f(None, "http(s) URL the batches are POSTed to (required with scorer 'remote')")
    batch_size: PositiveInt = _f(64, "Samples per request")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return _http_url(v)


class JudgeConfig(HttpEndpointConfig):
    """An LLM judge behind an OpenAI-compatible chat-completions endpoint (scorer 'judge')."""

    base_url: str | None = _f(
        None, "OpenAI-compatible API base, e.g. http://host:8000/v1 (required with 'judge')"
    )
    model: str | None = _f(None, "Model name the endpoint serves (required with scorer 'judge')")
    template: str = _f(JUDGE_TEMPLATE, "User message; str.format fields {prompt}, {response}, {ground_truth}")
    score_pattern: str = _f(
        r"Score:\s*([0-9]+(?:\.[0-9]+)?)", "Regex with one group: the score in the judge's reply (last match)"
    )
    score_scale: PositiveFloat = _f(10.0, "Parsed score / score_scale is the reward (must land in [0, 1])")
    temperature: NonNegFloat = _f(0.0, "Judge sampling temperature")
    max_tokens: PositiveInt = _f(256, "Most tokens the judge may write")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        url = _http_url(v)
        return None if url is None else url.rstrip("/")

    @field_validator("template")
    @classmethod
    def _template_fields(cls, v: str) -> str:
        import string

        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
        except ValueError as e:
            raise ValueError(f"not a str.format template ({e}); write literal braces as {{{{ }}}}") from None
        unknown = sorted(fields - _TEMPLATE_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; known: {sorted(_TEMPLATE_FIELDS)}")
        return v

    @field_validator("score_pattern")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            groups = re.compile(v).groups
        except re.error as e:
            raise ValueError(f"not a regex: {e}") from None
        if groups != 1:
            raise ValueError(f"needs exactly one group (the score), has {groups}")
        return v


class RewardConfig(Section):
    """Rewards: the weighted sum of ``scorers`` plus DAPO's overlong penalty (see verl_core.reward)."""

    scorers: list[RewardScorerConfig] = _f(
        [RewardScorerConfig()],
        "Scorers summed with their weights (each name once; a string is a scorer of weight 1)",
        min_length=1,
    )
    gsm8k_method: Literal["strict", "flexible"] = _f(
        "strict", "GSM8K answer extraction: last '#### N' (strict) or last number (flexible)"
    )
    score: float = _f(1.0, "Rule score of a correct answer")
    format_score: float = _f(0.0, "Rule score of an extracted but wrong answer (no answer: 0)")
    function: str | None = _f(None, "Custom reward 'package.module:function' (scorer 'function')")
    function_mode: Literal["batch", "sample"] = _f(
        "sample", "Custom function form: one call per batch (lists in, list out) or one call per sample"
    )
    timeout_s: PositiveFloat = _f(
        10.0, "Seconds a custom-function call may take (per sample, or per batch in batch mode)"
    )
    correct_threshold: float = _f(
        1.0, "A sample is correct when its score is ≥ this, unless a rule scorer reports correctness"
    )
    on_error: Literal["fail", "zero"] = _f(
        "fail", "A scorer raising or timing out on a sample: fail the stage, or score 0 and count it"
    )
    model_path: str | None = _f(None, "Reward model: HF dir or hub id of a 1-label sequence classifier")
    model_dtype: Literal["float32", "bfloat16"] = _f("float32", "Reward model parameter dtype")
    model_device: Literal["auto", "cpu", "cuda"] = _f("auto", "Reward model device (auto: cuda if available)")
    model_max_tokens_per_batch: PositiveInt = _f(8192, "Token budget of one packed reward-model forward")
    overlong_buffer_len: NonNegInt = _f(
        0, "DAPO overlong penalty: buffer L_cache before max_response_length (0: no penalty)"
    )
    overlong_penalty_factor: NonNegFloat = _f(1.0, "DAPO overlong penalty: weight of the penalty in [-1, 0]")
    num_workers: NonNegInt = _f(2, "Processes for rule scoring of large batches (0 or 1: in-process)")
    parallel_min_samples: PositiveInt = _f(
        10000, "Rule scoring uses the process pool from this many samples (smaller batches: in-process)"
    )
    code_score: Literal["fraction", "all"] = _f(
        "fraction", "Code scorer: the fraction of the row's asserts that pass, or 1 only when all pass"
    )
    code_workers: PositiveInt = _f(2, "Code scorer: sandboxes run at once (threads)")
    remote: RemoteRewardConfig = _f(RemoteRewardConfig(), "Remote batch-scoring endpoint (scorer 'remote')")
    judge: JudgeConfig = _f(JudgeConfig(), "LLM judge on an OpenAI-compatible endpoint (scorer 'judge')")

    @field_validator("scorers", mode="before")
    @classmethod
    def _scorer_names(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [{"name": x} if isinstance(x, str) else x for x in v]
        return v

    @model_validator(mode="after")
    def _scorers_are_complete(self) -> RewardConfig:
        names = [s.name for s in self.scorers]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"reward.scorers: {', '.join(repeated)} given more than once")
        if "function" in names and not self.function:
            raise ValueError("reward.function: required when reward.scorers has 'function' (module:function)")
        if "model" in names and not self.model_path:
            raise ValueError("reward.model_path: required when reward.scorers has 'model'")
        if "remote" in names and not self.remote.url:
            raise ValueError("reward.remote.url: required when reward.scorers has 'remote'")
        if "judge" in names and not (self.judge.base_url and self.judge.model):
            raise ValueError(
                "reward.judge.base_url, reward.judge.model: required when reward.scorers has 'judge'"
            )
        return self


class KLControlConfig(Section):
    type: KLControllerName = _f("fixed", "KL coefficient controller")
    kl_coef: NonNegFloat = _f(0.001, "Initial β of the KL-in-reward penalty")
    target_kl: PositiveFloat = _f(0.1, "Target KL of the adaptive controller")
    horizon: PositiveInt = _f(10000, "Horizon of the adaptive controller")


class RolloutCorrectionConfig(Section):
    rollout_is: RolloutISLevel | None = _f(
        None, "Truncated importance weights π_old/π_rollout on the actor loss: token | sequence (None: off)"
    )
    rollout_is_threshold: PositiveFloat = _f(2.0, "Truncation C of the importance weights (w ← min(w, C))")
    rollout_rs: RolloutRSLevel | None = _f(
        None, "Reject tokens/sequences whose weight leaves the thresholds: token | sequence | geometric"
    )
    rollout_rs_threshold: PositiveFloat = _f(2.0, "Rejection sampling: upper bound of a kept weight")
    rollout_rs_threshold_lower: PositiveFloat | None = _f(
        None, "Rejection sampling: lower bound of a kept weight (None: 1 / rollout_rs_threshold)"
    )
    log_prob_diff_threshold: PositiveFloat = _f(
        0.1, "Metric rollout_corr/log_prob_abs_diff_frac_above counts tokens with |Δ log-prob| above this"
    )


class FilterGroupsConfig(Section):
    enable: bool = _f(False, "DAPO dynamic sampling: drop prompt groups whose samples agree on the metric")
    metric: Literal["acc", "score"] = _f("acc", "What must differ within a group: acc (correct) or score")
    max_num_gen_batches: NonNegInt = _f(
        10, "Generation batches per iteration at most; then train on the groups found (0: no limit)"
    )


class AlgorithmConfig(Section):
    adv_estimator: AdvEstimator = _f("grpo", "Advantage estimator")
    gamma: Prob = _f(1.0, "Discount factor")
    lam: Prob = _f(1.0, "GAE λ")
    norm_adv_by_std_in_grpo: bool = _f(True, "Divide GRPO advantages by the group std (false: Dr.GRPO)")
    use_kl_in_reward: bool = _f(False, "Subtract β·KL(actor || ref) from the token rewards")
    kl_penalty: KLEstimator = _f("kl", "KL estimator used in the reward")
    kl_ctrl: KLControlConfig = _f(KLControlConfig(), "KL coefficient control")
    rollout_correction: RolloutCorrectionConfig = _f(
        RolloutCorrectionConfig(), "Rollout/trainer log-prob mismatch: metrics, importance weights, rejection"
    )
    filter_groups: FilterGroupsConfig = _f(FilterGroupsConfig(), "DAPO dynamic sampling (oversample, filter)")

    @property
    def greedy_baseline(self) -> bool:
        """ReMax's baseline is the reward of a greedy response: the rollout samples one per prompt."""
        return self.adv_estimator == "remax"


class TrainerConfig(Section):
    project_name: str = _f("verl-flow", "Project: the MLflow experiment name")
    experiment_name: str = _f("quickstart", "Experiment: prefix of generated run ids, MLflow run name")
    total_iterations: PositiveInt = _f(20, "RL iterations (rollout, reward, update)")
    total_epochs: PositiveInt = _f(100, "Upper bound on passes over the prompt set")
    test_freq: NonNegInt = _f(5, "Validate every this many iterations (0: never)")
    val_before_train: bool = _f(True, "Validate before the first iteration")
    save_freq: NonNegInt = _f(10, "Checkpoint every this many iterations (0: only at the end)")
    critic_warmup: NonNegInt = _f(0, "Iterations that update only the critic before the actor starts")
    max_ckpt_to_keep: PositiveInt = _f(2, "Checkpoints kept (older ones deleted)")
    resume_mode: str = _f("auto", "auto (resume the run if it exists) | disable | an iteration number")
    seed: int = _f(1, "Global seed (torch, python, numpy)")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "Device for model stages (auto: cuda if available)")
    nnodes: PositiveInt = _f(1, "Nodes of the SFT and RL-loop jobs (more than one process: torchrun)")
    n_gpus_per_node: PositiveInt = _f(
        1, "Processes per node, one per GPU (on CPU: processes); nnodes × this is the world size"
    )
    rdzv_endpoint: str | None = _f(
        None, "host:port of the c10d rendezvous of a multi-node job (None: this host, one node)"
    )
    rdzv_id: str = _f(
        "verl-flow", "c10d rendezvous id of multi-node jobs; followers (verl-flow spmd-follow) pass the same"
    )
    rollout_ahead: int = _f(
        0,
        "Policy versions a rollout lags the trainer (0: on-policy; 1: rollout i+1 is sampled from policy i "
        "beside update i, an engine with its own weights, one process); ppo_update refuses an older batch",
        ge=0,
        le=1,
    )

    @field_validator("resume_mode")
    @classmethod
    def _resume_mode(cls, v: str) -> str:
        if v in ("auto", "disable") or v.isdigit():
            return v
        raise ValueError("'auto', 'disable' or an iteration number")


class StoreConfig(Section):
    url: str = _f(
        "runs",
        "Artifact store root: a local path or file://, s3://bucket/prefix, or memory:// "
        "(S3 endpoint and credentials come from the environment only)",
    )
    max_attempts: PositiveInt = _f(10, "botocore attempts per S3 request (standard retry mode)")
    outage_budget_s: PositiveFloat = _f(
        300.0,
        "Seconds an unreachable S3 endpoint is waited for (requests retried with backoff) before the run "
        "fails in one line; a rerun resumes",
    )
    lease_ttl_s: PositiveFloat = _f(
        120.0, "Seconds a run's lease outlives its last renewal (a crashed holder on another host)"
    )


class TrackingConfig(Section):
    enabled: bool = _f(
        True, "Log params, metrics, sample tables and plots to each of tracking.backends (false: to none)"
    )
    backends: list[Literal["mlflow", "wandb"]] = _f(
        ["mlflow"],
        "Where tracking.enabled logs, all at once; wandb needs pip install 'verl-flow[wandb]', its API key, "
        "mode and directory come from WANDB_API_KEY, WANDB_MODE, WANDB_DIR only",
    )
    uri: str | None = _f(None, "MLflow tracking URI (None: sqlite mlflow.db beside a local store)")
    wandb_project: str | None = _f(None, "W&B project (None: trainer.project_name)")
    wandb_entity: str | None = _f(None, "W&B entity, a user or team (None: the API key's default)")
    log_samples: NonNegInt = _f(
        8, "Samples per RL iteration (and validation) logged as a table: prompt, response, score, advantage"
    )


class ExportConfig(Section):
    enable: bool = _f(True, "Export the final policy as a merged HF model dir after RL (pipeline stage)")
    register_model: bool = _f(True, "Register the exported model in the MLflow model registry")
    registered_model_name: str | None = _f(
        None, "MLflow registered model name (None: '{trainer.project_name}-{trainer.experiment_name}')"
    )


class EvalConfig(Section):
    enable: bool = _f(True, "Evaluate the exported policy as the pipeline's last stage")
    max_samples: NonNegInt = _f(0, "Evaluate at most this many held-out prompts (0: all)")
    k: PositiveInt = _f(4, "Sampled responses per prompt for pass@k (k=1 skips sampling)")
    temperature: PositiveFloat = _f(1.0, "Temperature of the pass@k samples (the greedy pass uses 0)")
    top_p: float = _f(1.0, "Nucleus sampling mass of the pass@k samples", gt=0, le=1)
    seed: int = _f(1, "Sampling seed of the pass@k samples")
    table_rows: NonNegInt = _f(20, "Sample completions shown in the Prefect/MLflow table artifact")


class SandboxConfig(Section):
    """Where untrusted code runs (the code scorer, the python tool): bubblewrap, see
    verl_core.runtime.sandbox."""

    allow_weak_sandbox: bool = _f(
        False, "Without bwrap, run code in a plain subprocess (rlimits, empty env; no network/file isolation)"
    )
    timeout_s: PositiveFloat = _f(5.0, "Wall-clock seconds of one run, then its processes are killed")
    cpu_time_s: PositiveInt = _f(5, "CPU seconds of one run (RLIMIT_CPU)")
    memory_mb: PositiveInt = _f(512, "Address space of each sandboxed process in MiB (RLIMIT_AS)")
    max_processes: PositiveInt = _f(32, "Processes one run may add (RLIMIT_NPROC over the user's count)")
    max_output_bytes: PositiveInt = _f(16384, "Bytes of stdout and of stderr kept; more stops the run")
    max_file_mb: PositiveInt = _f(16, "Largest file the code may write, and the size of its /tmp, in MiB")


class ExecutionConfig(Section):
    mode: Literal["local", "deployments"] = _f(
        "local", "local: one process, no server; deployments: GPU stages on the gpu work pool"
    )
    shared_filesystem: bool = _f(
        False,
        "deployments: local paths (a file:// store, a sqlite tracking URI) are on a filesystem every "
        "worker mounts at the same path",
    )
    sft_deployment: str = _f("sft-warmup/gpu", "deployments: the SFT warm-up flow's deployment (flow/name)")
    rl_deployment: str = _f("rl-loop/gpu", "deployments: the RL loop flow's deployment (flow/name)")
    export_deployment: str = _f("export-model/gpu", "deployments: the export flow's deployment (flow/name)")
    poll_interval_s: PositiveFloat = _f(5.0, "deployments: seconds between checks of a dispatched flow run")
    lost_after_s: PositiveFloat = _f(
        120.0,
        "deployments: a dispatched stage flow run whose heartbeat (its stage lease in the store, renewed "
        "every lost_after_s/3) stood still this long is lost (its worker preempted): marked Crashed and "
        "dispatched again",
    )
    start_timeout_s: PositiveFloat = _f(
        600.0,
        "deployments: a stage flow run taken by a worker that has not started its heartbeat this long after "
        "(process start, imports, environment check) is lost too",
    )
    redispatch_retries: NonNegInt = _f(
        2,
        "deployments: times a lost or crashed stage flow run is dispatched again (resuming from its "
        "checkpoint)",
    )
    redispatch_timeout_s: PositiveFloat = _f(
        600.0,
        "deployments: fail when a dispatched stage flow run has waited this long for a worker while no "
        "worker of its pool is online",
    )
    api_outage_s: PositiveFloat = _f(
        300.0, "deployments: fail when the Prefect API has not answered the dispatcher for this long"
    )
    task_retries: NonNegInt = _f(2, "Prefect retries of I/O-bound stage tasks")
    retry_delay_s: NonNegFloat = _f(5.0, "Seconds between task retries")
    stall_timeout_s: NonNegFloat = _f(
        1800.0, "Fail a compute stage (or collective) with no progress for this many seconds (0: never)"
    )


class ParentConfig(Section):
    """The run this one branches from (``verl-flow run CONFIG --fork RUN@ITER``, ``verl-flow replay``):
    the parent's committed checkpoint ``ckpt/iter-ITER`` in the same store is the starting state."""

    run_id: str = _f(..., "The parent run's id (in this run's store)")
    iteration: PositiveInt = _f(..., "Start from the parent's checkpoint after this many updates")
    replay: bool = _f(
        False,
        "Train on the parent's stored rollouts and rewards of iterations iteration.. instead of sampling "
        "(verl-flow replay)",
    )
    rewards: str | None = _f(
        None, "replay: the rewards of the parent's rescore of this name (None: the parent's own rewards)"
    )


# Where and how models are placed, not what they compute: left out of the identity of a policy's
# trajectory (a run resumes on another world size or strategy) and of the update stage's inputs.
PLACEMENT_FIELDS: dict[str, set[str]] = {
    "actor": {"strategy", "zero_stage", "param_offload", "tensor_parallel_size"},
    "critic": {"strategy", "zero_stage", "param_offload"},
    "ref": {"strategy", "param_offload"},
    "rollout": {"share_weights"},
}


class VerlFlowConfig(Section):
    """The whole run."""

    data: DataConfig = _f(DataConfig(), "Datasets, lengths, batching")
    model: ModelConfig = _f(ModelConfig(), "Base model, LoRA/QLoRA")
    sft: SFTConfig = _f(SFTConfig(), "SFT warm-up")
    actor: ActorConfig = _f(ActorConfig(), "Policy optimisation")
    critic: CriticConfig = _f(CriticConfig(), "Value model")
    ref: RefConfig = _f(RefConfig(), "Reference policy")
    rollout: RolloutConfig = _f(RolloutConfig(), "Generation")
    reward: RewardConfig = _f(RewardConfig(), "Reward scoring")
    algorithm: AlgorithmConfig = _f(AlgorithmConfig(), "Advantages and KL")
    trainer: TrainerConfig = _f(TrainerConfig(), "The RL loop, checkpoints, seeds")
    store: StoreConfig = _f(StoreConfig(), "Artifact store")
    tracking: TrackingConfig = _f(TrackingConfig(), "Experiment tracking (MLflow, W&B)")
    export: ExportConfig = _f(ExportConfig(), "Merged HF model export and registry")
    eval: EvalConfig = _f(EvalConfig(), "Evaluation of the exported policy")
    execution: ExecutionConfig = _f(ExecutionConfig(), "Where stages run")
    sandbox: SandboxConfig = _f(SandboxConfig(), "Untrusted code: the code scorer and the python tool")
    parent: ParentConfig | None = _f(
        None, "Fork or replay: start from another run's checkpoint (None: a run of its own, the default)"
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> VerlFlowConfig:
        # every problem on its own line (verl_core.config.preflight), all of them at once
        from verl_core.config.preflight import problems

        found = problems(self)
        if found:
            raise ValueError("\n".join(found))
        return self

    @property
    def world_size(self) -> int:
        """Processes of the SFT and RL-loop jobs: ``trainer.nnodes × trainer.n_gpus_per_node``."""
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def use_critic(self) -> bool:
        """Whether the run trains a critic (explicit flag, else only for GAE)."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    def section_without_placement(self, name: str) -> dict[str, Any]:
        """Section ``name`` as JSON without its :data:`PLACEMENT_FIELDS`."""
        section: Section = getattr(self, name)
        return section.model_dump(mode="json", exclude=PLACEMENT_FIELDS.get(name))

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the resolved config (see :func:`.loader.config_hash`)."""
        from verl_core.config.loader import config_hash

        return config_hash(self)
