"""The generation and reward sections: the rollout engine and multi-turn tools; the scorers, their
HTTP endpoints (remote, judge) and the reward shaping."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import field_validator, model_validator

from verl_core.config.base import NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, Section, _f


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
        0.5,
        "vLLM share of accelerator memory (weights + KV cache) when kv_cache_gib is None; with kv_cache_gib, "
        "the share vLLM's start-up check asks to be free, lowered to the free share measured "
        "(verl_core.rollout.vllm_spec)",
        gt=0,
        le=1,
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
        False, "vLLM: no torch.compile / CUDA graphs (a faster engine start, slower generation)"
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
    decode: Literal["auto", "loop", "compiled"] = _f(
        "auto",
        "HF engine decoding: own eager loop or compiled CUDA-graph step (auto: compiled on CUDA, else loop)",
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
    function: str | None = _f(
        None,
        "Custom reward 'package.module:function' or 'path/to/file.py:function' (scorer 'function'; verl's "
        "compute_score signatures work as written, see verl_core.reward.call_forms)",
    )
    function_mode: Literal["batch", "sample"] = _f(
        "sample", "Custom function form: one call per batch (lists in, list out) or one call per sample"
    )
    function_kwargs: dict[str, Any] = _f(
        {},
        "Extra keyword arguments of every reward.function call (verl's custom_reward_function.reward_kwargs)",
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
