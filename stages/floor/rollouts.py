"""Rollout generation: an iteration's sampling parameters, one engine's rollouts (single-turn, or the
multi-turn loop with tools), and the rollouts of every engine of an SPMD job gathered on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from stages.floor.scorers import sandbox_spec
from verl_core.config import MultiTurnConfig, RolloutConfig, SandboxConfig
from verl_core.data.templates import CHATML
from verl_core.errors import ConfigError
from verl_core.rollout import Completion, RolloutEngine, SamplingParams
from verl_core.rollout.multi_turn import (
    MultiTurnSpec,
    ToolTurnRenderer,
    Trajectory,
    multi_turn_generate,
    multi_turn_metrics,
)
from verl_core.runtime.ranks import all_gather, rank, world_size
from verl_core.seeding import derive_seed
from verl_core.tools import load_tools
from verl_core.tools.parsing import TOOL_CALL_FORMATS
from verl_core.training.distributed import rank_shard


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
