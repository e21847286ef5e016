"""Config sections → verl_core objects: the policy, reward scorers, sampling parameters, optimizer
specs, rollout engine arguments, and the number of RL iterations a run plans. Stages call these so
that one config knob means one thing everywhere (the RL loop, validation, eval, benchmarks)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn

from stages.floor.initial_model import model_dir
from verl_core.algorithms.rollout_correction import RolloutCorrectionSpec
from verl_core.config import (
    JudgeConfig,
    MixedPrecisionConfig,
    ModelConfig,
    MultiTurnConfig,
    RemoteRewardConfig,
    RewardConfig,
    RolloutConfig,
    SandboxConfig,
    VerlFlowConfig,
    canonical_json,
)
from verl_core.data.templates import CHATML
from verl_core.errors import ConfigError
from verl_core.models.loading import (
    QuantSpec,
    ScratchSpec,
    apply_liger,
    apply_lora,
    enable_gradient_checkpointing,
    init_causal_lm,
    load_causal_lm,
    scratch_config,
    unwrap,
)
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
from verl_core.rollout import Completion, RolloutEngine, SamplingParams, make_engine
from verl_core.rollout.multi_turn import (
    MultiTurnSpec,
    ToolTurnRenderer,
    Trajectory,
    multi_turn_generate,
    multi_turn_metrics,
)
from verl_core.rollout.placement import GroupMemberEngine, current_topology, engine_placement
from verl_core.rollout.vllm_spec import VLLMSpec
from verl_core.runtime.ranks import all_gather, rank, world_size
from verl_core.runtime.run_length import StepCount
from verl_core.runtime.sandbox import SandboxSpec, check_sandbox
from verl_core.seeding import derive_seed
from verl_core.tools import load_tools
from verl_core.tools.parsing import TOOL_CALL_FORMATS
from verl_core.training.distributed import rank_shard
from verl_core.training.engine import OptimSpec
from verl_core.training.ppo import PPOSpec
from verl_core.training.ppo_kernels import ActorLossSpec
from verl_core.training.precision import MixedPrecision

# --------------------------------------------------------------------------------------------------
# Policy and reference


def quant_spec(model: ModelConfig) -> QuantSpec | None:
    """The bitsandbytes quantization of the base (QLoRA), None without ``model.quantization``."""
    if model.quantization is None:
        return None
    if model.lora_rank == 0:
        raise ConfigError(
            "model.quantization: a quantized base can only be trained with LoRA (model.lora_rank > 0)"
        )
    q = model.quantization
    return QuantSpec(q.bits, q.quant_type, q.double_quant, q.compute_dtype)


def build_policy(model: ModelConfig, tokenizer: Any, *, seed: int) -> nn.Module:
    """The initial policy: a scratch model sized by ``model`` for ``tokenizer``'s vocabulary, or the
    pretrained ``model.path``; LoRA adapters when ``model.lora_rank > 0``."""
    quant = quant_spec(model)
    if model.init == "scratch":
        if quant is not None:
            raise ConfigError("model.quantization: not supported for model.init=scratch")
        spec = ScratchSpec(
            model.architecture,
            model.hidden_size,
            model.num_hidden_layers,
            model.num_attention_heads,
            model.num_key_value_heads,
            model.intermediate_size,
            model.max_position_embeddings,
        )
        config = scratch_config(
            spec, len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        lm = init_causal_lm(
            config, seed=seed, dtype=model.dtype, attn_implementation=model.attn_implementation
        )
    else:
        assert model.path is not None  # the config's cross-checks guarantee it
        lm = load_causal_lm(
            model_dir(model.path),  # a store URI: this process's copy (stages.floor.initial_model)
            dtype=model.dtype,
            attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code,
            quantization=quant,
        )
    if model.lora_rank > 0:
        lm = apply_lora(
            lm,
            rank=model.lora_rank,
            alpha=model.lora_alpha,
            dropout=model.lora_dropout,
            target_modules=model.target_modules,
            quantized=quant is not None,
        )
    if model.use_liger:
        apply_liger(lm)
    if model.gradient_checkpointing:
        enable_gradient_checkpointing(lm)
    return lm


def mixed_precision(section: MixedPrecisionConfig) -> MixedPrecision | None:
    """The ``mixed_precision`` of an actor/critic/ref section; None when ``param_dtype`` is unset."""
    return MixedPrecision.from_names(section.param_dtype, section.reduce_dtype, section.buffer_dtype)


def load_reference(cfg: VerlFlowConfig, policy: nn.Module) -> nn.Module:
    """The frozen reference policy ``ref.path`` (hub id or local dir). It scores the policy's tokens,
    so a vocabulary other than the policy's is refused."""
    assert cfg.ref.path is not None
    ref = load_causal_lm(
        cfg.ref.path,
        dtype=cfg.model.dtype,
        attn_implementation=cfg.model.attn_implementation,
        trust_remote_code=cfg.model.trust_remote_code,
        field="ref.path",
    )
    ours, theirs = unwrap(policy).config.vocab_size, ref.config.vocab_size
    if ours != theirs:
        raise ConfigError(
            f"ref.path: {cfg.ref.path!r} has a vocabulary of {theirs} tokens, the policy {ours}: "
            "the reference must use the policy's tokenizer"
        )
    return ref.eval().requires_grad_(False)


# --------------------------------------------------------------------------------------------------
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


_RUN_SCORERS: dict[str, dict[str, list[WeightedScorer]]] = {}  # run id → sections' JSON → scorers


def run_scorers(run_id: str, cfg: RewardConfig, sandbox: SandboxConfig) -> list[WeightedScorer]:
    """The scorers of ``cfg`` (and ``sandbox``) for run ``run_id``, built on the phase's first call and
    reused until :func:`drop_scorers` ends the phase (the RL loop): a ``model`` scorer loads its weights
    once, not every iteration. Keyed by the two sections' JSON, so another config gets its own. The
    cost: a reward model stays on ``reward.model_device`` through the whole phase, updates included;
    size the device for it."""
    key = canonical_json([cfg.model_dump(mode="json"), sandbox.model_dump(mode="json")])
    built = _RUN_SCORERS.setdefault(run_id, {})
    if key not in built:
        built[key] = build_scorers(cfg, sandbox)
    return built[key]


def drop_scorers(run_id: str) -> None:
    """Forget run ``run_id``'s scorers (a reward model's weights are freed with them)."""
    _RUN_SCORERS.pop(run_id, None)


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


# --------------------------------------------------------------------------------------------------
# Rollout


def sampling_params(
    rollout: RolloutConfig, max_new_tokens: int, iteration: int, *, validation: bool
) -> SamplingParams:
    """Sampling of iteration ``iteration``'s training rollouts, or of its validation (greedy by default);
    seeded by (rollout.seed, iteration), validation apart from training."""
    temperature = rollout.val_temperature if validation else rollout.temperature
    return SamplingParams(
        n=rollout.val_n if validation else rollout.n,
        temperature=temperature,
        top_p=1.0 if validation else rollout.top_p,
        top_k=-1 if validation else rollout.top_k,
        max_new_tokens=max_new_tokens,
        stop=tuple(rollout.stop),
        seed=derive_seed("validate" if validation else "rollout", rollout.seed, iteration),
    )


EngineKwargs = Callable[[VerlFlowConfig], dict[str, Any]]
ENGINE_KWARGS: Registry[EngineKwargs] = Registry("rollout engine")  # one entry per verl_core.rollout.ENGINES


def compute_dtype(cfg: VerlFlowConfig) -> str:
    """The dtype the policy computes in, which its rollouts use too: ``actor.mixed_precision.param_dtype``
    when set (fp32 master weights, bf16 compute), else ``model.dtype``."""
    return cfg.actor.mixed_precision.param_dtype or cfg.model.dtype


@ENGINE_KWARGS.register("hf")
def _hf_engine_kwargs(cfg: VerlFlowConfig) -> dict[str, Any]:
    rollout = cfg.rollout
    return {
        "max_batch_size": rollout.max_batch_size,
        "share_weights": rollout.share_weights,
        "decode": rollout.decode,
        "compute_dtype": compute_dtype(cfg),
    }


def vllm_spec(cfg: VerlFlowConfig) -> VLLMSpec:
    """The vLLM engine's settings: the ``rollout`` section's, in the policy's compute dtype."""
    rollout = cfg.rollout
    return VLLMSpec(
        dtype=compute_dtype(cfg),  # never vLLM's "auto", which would halve a float32 model
        trust_remote_code=cfg.model.trust_remote_code,
        tensor_parallel_size=rollout.tensor_parallel_size,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        kv_cache_gib=rollout.kv_cache_gib,
        cpu_kv_cache_gib=rollout.cpu_kv_cache_gib,
        enforce_eager=rollout.vllm_enforce_eager,
        max_model_len=None,  # the model's own context length
        weight_sync_bucket_mb=rollout.weight_sync_bucket_mb,
    )


@ENGINE_KWARGS.register("vllm")
def _vllm_engine_kwargs(cfg: VerlFlowConfig) -> dict[str, Any]:
    return {"spec": vllm_spec(cfg), "vllm_python": cfg.rollout.vllm_python}


@ENGINE_KWARGS.register("auto")
def _auto_engine_kwargs(cfg: VerlFlowConfig) -> dict[str, Any]:
    """Both engines' arguments: ``auto`` picks one when it is built (it knows the device then)."""
    return {"hf": _hf_engine_kwargs(cfg), "vllm": _vllm_engine_kwargs(cfg)}


def engine_kwargs(cfg: VerlFlowConfig) -> dict[str, Any]:
    """Keyword arguments of ``verl_core.rollout.make_engine(cfg.rollout.name, ...)``."""
    return ENGINE_KWARGS.get(cfg.rollout.name)(cfg)


def build_rollout_engine(
    cfg: VerlFlowConfig, lm: nn.Module, tokenizer: Any, device: torch.device
) -> RolloutEngine:
    """This rank's rollout engine for the policy ``lm`` (moved to ``device``). One process: the
    ``rollout.name`` engine. Under torchrun (:mod:`verl_core.rollout.placement`): ``auto`` is resolved
    for ``device`` first (every rank alike); an engine spans ``rollout.tensor_parallel_size`` ranks
    (vLLM; the HF engine one), its group's first rank starts it pinned to the group's devices or cores,
    and the group's other ranks hold a :class:`GroupMemberEngine` (:func:`sharded_rollouts` hands them
    the group's rollouts)."""
    lm, rollout = lm.to(device), cfg.rollout
    if world_size() == 1:
        return make_engine(rollout.name, lm, tokenizer, **engine_kwargs(cfg))
    name = resolved_engine_name(rollout.name, device.type, rollout.vllm_python)
    tensor_parallel_size = rollout.tensor_parallel_size if name == "vllm" else 1
    placement = engine_placement(current_topology(), tensor_parallel_size, device.type)
    engine: RolloutEngine = GroupMemberEngine(tensor_parallel_size)
    failed: BaseException | None = None
    if placement.owner:
        kwargs = ENGINE_KWARGS.get(name)(cfg)
        if name == "vllm":
            kwargs["env"] = dict(placement.env)
        try:
            engine = make_engine(name, lm, tokenizer, **kwargs)
        except Exception as e:  # raised below, once every rank knows
            failed = e
    # every rank waits here for every engine: a group's other ranks load nothing onto the devices an
    # engine is measuring and profiling, and one engine failing to start fails every rank now instead
    # of leaving the others in the next collective until its timeout
    failures = [f for f in all_gather([None if failed is None else f"rank {rank()}: {failed}"]) if f]
    if failed is not None:
        raise failed
    if failures:
        engine.close()
        raise RuntimeError(f"rollout engine start failed on {len(failures)} rank(s): {'; '.join(failures)}")
    return engine


def resolved_engine_name(name: str, device_type: str, vllm_python: str) -> str:
    """``rollout.name`` with ``auto`` decided for ``device_type`` as ``make_engine("auto", ...)`` decides
    it (:data:`verl_core.rollout.registry.AUTO_ENGINE`, hf where vLLM is not available)."""
    from verl_core.rollout.registry import AUTO_ENGINE, _vllm_ready

    if name != "auto":
        return name
    chosen = AUTO_ENGINE.get(device_type, "hf")
    return chosen if chosen != "vllm" or _vllm_ready(vllm_python) else "hf"


# --------------------------------------------------------------------------------------------------
# RL schedule and optimizers


def planned_iterations(cfg: VerlFlowConfig, n_prompts: int) -> int:
    """RL iterations of the run: ``trainer.total_iterations``, capped by ``trainer.total_epochs`` passes
    over the ``n_prompts`` training prompts (each iteration takes ``data.train_batch_size`` of them)."""
    t = cfg.trainer
    return min(t.total_iterations, math.ceil(t.total_epochs * n_prompts / cfg.data.train_batch_size))


def iteration_count(cfg: VerlFlowConfig, planned: int, completed: int) -> StepCount:
    """The RL loop's :class:`StepCount`: ``planned`` from :func:`planned_iterations`, the reason when
    it is below ``trainer.total_iterations`` (the epoch cap, the only one)."""
    t = cfg.trainer
    cap = None
    if planned < t.total_iterations:
        cap = f"trainer.total_epochs={t.total_epochs} passes over the training prompts"
    return StepCount(
        unit="RL iterations", requested=t.total_iterations, planned=planned, completed=completed, cap=cap
    )


def optim_spec(
    *, lr: float, weight_decay: float, grad_clip: float, total_steps: int, warmup_ratio: float, scheduler: str
) -> OptimSpec:
    """AdamW and its LR schedule over ``total_steps`` optimizer steps, the first
    ``int(warmup_ratio · total_steps)`` of them a linear warm-up (the actor, the critic and SFT)."""
    return OptimSpec(
        lr=lr,
        weight_decay=weight_decay,
        warmup_steps=int(warmup_ratio * total_steps),
        total_steps=total_steps,
        scheduler=scheduler,
        grad_clip=grad_clip,
    )


def actor_spec(cfg: VerlFlowConfig, iterations: int) -> OptimSpec:
    """The actor's optimizer and LR schedule over ``iterations`` RL iterations
    (``actor.ppo_epochs`` × mini-batches optimizer steps each)."""
    a = cfg.actor
    total = iterations * a.ppo_epochs * (cfg.data.train_batch_size // a.ppo_mini_batch_size)
    return optim_spec(
        lr=a.lr, weight_decay=a.weight_decay, grad_clip=a.grad_clip, total_steps=total,
        warmup_ratio=a.warmup_steps_ratio, scheduler=a.lr_scheduler,
    )  # fmt: skip


def critic_spec(cfg: VerlFlowConfig, iterations: int) -> OptimSpec:
    """The critic's optimizer over ``iterations`` RL iterations (constant LR)."""
    c = cfg.critic
    total = iterations * c.ppo_epochs * (cfg.data.train_batch_size // c.ppo_mini_batch_size)
    return optim_spec(
        lr=c.lr, weight_decay=c.weight_decay, grad_clip=c.grad_clip, total_steps=total,
        warmup_ratio=0.0, scheduler="constant",
    )  # fmt: skip


S = TypeVar("S")


def _spec_from(spec_type: type[S], section: Any, **others: Any) -> S:
    """``spec_type`` (a dataclass) from ``section``'s fields of the same names, and ``others``."""
    names = [f.name for f in dataclasses.fields(spec_type) if f.name not in others]  # type: ignore[arg-type]
    return spec_type(**{n: getattr(section, n) for n in names}, **others)


def ppo_spec(cfg: VerlFlowConfig, iteration: int) -> PPOSpec:
    """The settings of iteration ``iteration``'s update (the actor waits out ``trainer.critic_warmup``).
    Fields named as in ``actor`` and ``algorithm`` (and its ``rollout_correction``) come from there."""
    a, c, alg = cfg.actor, cfg.critic, cfg.algorithm
    actor = _spec_from(
        ActorLossSpec,
        a,
        loss_agg_mode=a.resolved_loss_agg_mode,
        clip_ratio_low=a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
        temperature=cfg.rollout.temperature or 1.0,
    )
    return _spec_from(
        PPOSpec,
        alg,
        actor=actor,
        actor_epochs=a.ppo_epochs,
        actor_mini_batch_groups=a.ppo_mini_batch_size,
        critic_epochs=c.ppo_epochs,
        critic_mini_batch_groups=c.ppo_mini_batch_size,
        share_prompts=cfg.model.share_prompts,
        micro_batch_size=None if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu,
        actor_token_budget=a.ppo_max_token_len_per_gpu,
        critic_token_budget=c.ppo_max_token_len_per_gpu,
        log_prob_token_budget=cfg.rollout.log_prob_max_token_len_per_gpu,
        ref_token_budget=cfg.ref.log_prob_max_token_len_per_gpu,
        cliprange_value=c.cliprange_value,
        critic_loss_agg_mode=c.loss_agg_mode,
        horizon=float(cfg.data.max_response_length),
        update_actor=iteration >= cfg.trainer.critic_warmup,
        use_rollout_logprobs=a.use_rollout_logprobs,
        rollout_correction=_spec_from(RolloutCorrectionSpec, alg.rollout_correction),
    )


def update_seed(cfg: VerlFlowConfig, iteration: int) -> int:
    """The seed of iteration ``iteration``'s mini-batch order (the update stage and the benchmarks)."""
    return derive_seed("ppo_update", cfg.trainer.seed, iteration)


class Rollouts(NamedTuple):
    """What a stage writes: the completions, their multi-turn trajectories (None: single-turn), and
    the multi-turn metrics (empty for single-turn)."""

    completions: list[Completion]
    trajectories: list[Trajectory] | None
    metrics: dict[str, float]


def generate_rollouts(
    engine: RolloutEngine,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingParams,
    multi_turn: MultiTurnConfig,
    max_response_length: int,
    sandbox: SandboxConfig | None = None,
    prompt_keys: Sequence[int] | None = None,
) -> Rollouts:
    """``engine.generate``, or the multi-turn loop with tools when ``rollout.multi_turn.enable``: tool
    turns are rendered with the tokenizer's chat template (the one template_pack stored), and
    ``max_response_length`` bounds the whole response, model and tool tokens. Tools that run code
    (``python``) run in the sandbox ``sandbox.*`` describes. ``prompt_keys``: the prompts' sampling
    keys, their indices in the iteration's whole batch (default: their indices here), so a rank
    generating a shard draws the samples one process would."""
    if not multi_turn.enable:
        return Rollouts(engine.generate(prompt_ids, sampling, prompt_keys=prompt_keys), None, {})
    spec = MultiTurnSpec(
        max_turns=multi_turn.max_turns,
        max_tool_calls=multi_turn.max_tool_calls,
        max_tokens_per_turn=multi_turn.max_tokens_per_turn,
        max_response_tokens=max_response_length,
        tool_workers=multi_turn.tool_workers,
    )
    renderer = ToolTurnRenderer(
        getattr(tokenizer, "chat_template", None) or CHATML,
        bos_token=getattr(tokenizer, "bos_token", None) or "",
        eos_token=getattr(tokenizer, "eos_token", None) or "",
    )
    tools = load_tools(multi_turn.tools)
    if any(t.needs_sandbox for t in tools.values()):
        if sandbox is None:
            raise ConfigError(
                "rollout.multi_turn.tools: a tool that runs code needs the sandbox settings (sandbox.*)"
            )
        limits = sandbox_spec(sandbox)
        tools = {name: t.bound(limits) for name, t in tools.items()}
    call_format = TOOL_CALL_FORMATS.get(multi_turn.format)
    out = multi_turn_generate(
        engine, tokenizer, prompt_ids, sampling, tools, spec, renderer, call_format, prompt_keys=prompt_keys
    )
    return Rollouts([t.completion for t in out], out, multi_turn_metrics(out))


def sharded_rollouts(
    engine: RolloutEngine,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    sampling: SamplingParams,
    multi_turn: MultiTurnConfig,
    max_response_length: int,
    sandbox: SandboxConfig | None = None,
) -> Rollouts:
    """:func:`generate_rollouts` over every engine of an SPMD job (one process: the same call): each
    engine generates a Karmarkar–Karp share of the prompts (balanced by prompt length), each prompt
    keyed by its index in ``prompt_ids`` so it samples the tokens it would in one process, and every
    rank gets all the rollouts, in (prompt, sample) order. An engine with a ``tensor_parallel_size``
    (vLLM) spans that many consecutive ranks: the group's first rank holds it and generates the
    group's share, the others (:class:`GroupMemberEngine`) generate nothing and receive the share with
    everything else. With fewer prompts than engines, the first engines take one prompt each."""
    if world_size() == 1:  # one process (eval, a one-process loop): one engine, whatever its parallelism
        return generate_rollouts(
            engine, tokenizer, prompt_ids, sampling, multi_turn, max_response_length, sandbox
        )
    tensor_parallel_size = int(getattr(engine, "tensor_parallel_size", 1))
    group = rank() // tensor_parallel_size
    shards = min(world_size() // tensor_parallel_size, len(prompt_ids))
    pairs: list[tuple[Completion, Trajectory | None]] = []
    if rank() % tensor_parallel_size == 0 and group < shards:  # the engine's rank, with a share
        rows = rank_shard([len(p) for p in prompt_ids], group, shards)
        mine = generate_rollouts(
            engine, tokenizer, [prompt_ids[i] for i in rows], sampling, multi_turn, max_response_length,
            sandbox, prompt_keys=rows,
        )  # fmt: skip
        local = [c._replace(prompt_index=rows[c.prompt_index]) for c in mine.completions]
        if mine.trajectories is None:
            pairs = [(c, None) for c in local]
        else:
            pairs = [(c, t._replace(completion=c)) for t, c in zip(mine.trajectories, local, strict=True)]
    gathered = all_gather(pairs)
    gathered.sort(key=lambda pair: (pair[0].prompt_index, pair[0].sample_index))
    completions = [c for c, _ in gathered]
    if not multi_turn.enable:
        return Rollouts(completions, None, {})
    everything = [t for _, t in gathered if t is not None]
    return Rollouts(completions, everything, multi_turn_metrics(everything))
