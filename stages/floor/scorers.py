"""Reward scorers from the ``reward`` and ``sandbox`` sections: one builder per scorer name, the
sandbox spec of the scorers (and tools) that run code, and the one scoring call the reward stage,
validation, eval and the benchmarks share. The RL loop keeps its scorers in its session
(:meth:`stages.floor.session.RLSession.scorers`)."""

from __future__ import annotations

from collections.abc import Callable

from verl_core.config import JudgeConfig, RemoteRewardConfig, RewardConfig, SandboxConfig
from verl_core.registry import Registry
from verl_core.reward import (
    CodeScorer,
    FunctionScorer,
    HttpOptions,
    JudgeScorer,
    RemoteScorer,
    RewardBatch,
    RewardResult,
    RuleOptions,
    RuleScorer,
    Scorer,
    WeightedScorer,
    load_reward_function,
    score_rollouts,
)
from verl_core.reward.http import read_token
from verl_core.runtime.sandbox import SandboxSpec, check_sandbox

# Reward scorers: one builder per scorer name (the sandbox section for the scorers that run code)

SCORER_BUILDERS: Registry[Callable[[RewardConfig, SandboxConfig], Scorer]] = Registry("reward scorer")


def sandbox_spec(cfg: SandboxConfig) -> SandboxSpec:
    """``sandbox.*`` as the spec :func:`verl_core.runtime.sandbox.run_python` takes, once this machine is
    checked to run it: raises SandboxUnavailableError naming the fix (install bubblewrap, or
    ``sandbox.allow_weak_sandbox=true``). Call it where a scorer or tool that runs code is built."""
    return SandboxSpec(
        check_sandbox(cfg.allow_weak_sandbox),
        timeout_s=cfg.timeout_s,
        cpu_time_s=cfg.cpu_time_s,
        memory_mb=cfg.memory_mb,
        max_processes=cfg.max_processes,
        max_output_bytes=cfg.max_output_bytes,
        max_file_mb=cfg.max_file_mb,
    )


@SCORER_BUILDERS.register("rule")
def _rule(cfg: RewardConfig, sandbox: SandboxConfig) -> Scorer:
    options = RuleOptions(cfg.gsm8k_method, cfg.score, cfg.format_score)
    return RuleScorer(options, cfg.num_workers, cfg.parallel_min_samples)


@SCORER_BUILDERS.register("function")
def _function(cfg: RewardConfig, sandbox: SandboxConfig) -> Scorer:
    assert cfg.function is not None  # the config requires it with this scorer
    return FunctionScorer(
        load_reward_function(cfg.function), cfg.function_mode, cfg.timeout_s, cfg.function_kwargs
    )


@SCORER_BUILDERS.register("model")
def _model(cfg: RewardConfig, sandbox: SandboxConfig) -> Scorer:
    from verl_core.models.loading import resolve_device
    from verl_core.reward.model import ModelScorer, load_reward_scorer

    assert cfg.model_path is not None  # the config requires it with this scorer
    device = resolve_device(cfg.model_device, "reward.model_device")
    model, tokenizer = load_reward_scorer(cfg.model_path, dtype=cfg.model_dtype, device=device)
    return ModelScorer(model, tokenizer, cfg.model_max_tokens_per_batch)


def _http_options(endpoint: RemoteRewardConfig | JudgeConfig) -> HttpOptions:
    return HttpOptions(
        endpoint.token_env,
        endpoint.connect_timeout_s,
        endpoint.read_timeout_s,
        endpoint.max_retries,
        endpoint.backoff_s,
        endpoint.max_backoff_s,
        endpoint.max_concurrency,
    )


@SCORER_BUILDERS.register("remote")
def _remote(cfg: RewardConfig, sandbox: SandboxConfig) -> Scorer:
    assert cfg.remote.url is not None  # the config requires it with this scorer
    read_token(cfg.remote.token_env)  # an unset token variable fails here, before any rollout
    return RemoteScorer(cfg.remote.url, cfg.remote.batch_size, _http_options(cfg.remote))


@SCORER_BUILDERS.register("judge")
def _judge(cfg: RewardConfig, sandbox: SandboxConfig) -> Scorer:
    j = cfg.judge
    assert j.base_url is not None and j.model is not None  # the config requires them with this scorer
    read_token(j.token_env)
    return JudgeScorer(
        j.base_url,
        j.model,
        j.template,
        j.score_pattern,
        j.score_scale,
        j.temperature,
        j.max_tokens,
        _http_options(j),
    )


@SCORER_BUILDERS.register("code")
def _code(cfg: RewardConfig, sandbox: SandboxConfig) -> Scorer:
    return CodeScorer(sandbox_spec(sandbox), cfg.code_score, cfg.code_workers)


def build_scorers(cfg: RewardConfig, sandbox: SandboxConfig) -> list[WeightedScorer]:
    """The weighted scorers of ``reward.scorers`` (loads the function / reward model they name; an
    HTTP scorer's unset token variable fails here, and so does the code scorer without a sandbox)."""
    return [WeightedScorer(s.name, s.weight, SCORER_BUILDERS.get(s.name)(cfg, sandbox)) for s in cfg.scorers]


def score_batch(
    cfg: RewardConfig,
    sandbox: SandboxConfig,
    batch: RewardBatch,
    max_response_length: int,
    scorers: list[WeightedScorer] | None = None,
) -> RewardResult:
    """``batch`` scored as ``reward`` says (scorers, overlong penalty, errors, the accuracy rule): the
    one call the reward stage, validation, eval and the benchmarks share. ``scorers``: already built."""
    return score_rollouts(
        batch,
        build_scorers(cfg, sandbox) if scorers is None else scorers,
        on_error=cfg.on_error,
        max_response_length=max_response_length,
        overlong_buffer_len=cfg.overlong_buffer_len,
        overlong_penalty_factor=cfg.overlong_penalty_factor,
        correct_threshold=cfg.correct_threshold,
    )
