"""The data and model sections: datasets, lengths and chat templates; the base model, its precision,
LoRA/QLoRA."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator

from verl_core.config.base import NonNegInt, PositiveInt, Prob, Section, _f


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
    vocab_pad_to: PositiveInt | None = _f(
        None,
        "init=scratch: pad the trained tokenizer with unused ids up to this many, so the embedding and LM "
        "head have a real model's rows and cost (e.g. Qwen2.5's 151936); None: the trained size",
    )
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
    gradient_checkpointing: bool = _f(
        False, "Recompute activations in backward to save memory (the policy's and the critic's)"
    )
    use_liger: bool = _f(
        False,
        "Liger's fused RMSNorm/RoPE/SwiGLU kernels (qwen2, llama; CUDA; pip install 'verl-flow[liger]')",
    )
    torch_compile: bool = _f(
        False,
        "torch.compile each decoder layer for packed training/log-prob/critic forwards (generation "
        "stays eager); the first forward compiles (CPU: needs a C++ compiler; slower on CPU at the "
        "quickstart's size)",
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
