"""The RL session: what one run's RL loop works on, kept in memory for the whole loop, handed to the
RL stage bodies as a parameter.

:class:`RLSession` holds the actor (and its optimizer), the reference policy, the critic (and its
optimizer), the rollout engine, the reward scorers (built on first use, a reward model loads once per
loop), the KL controller, the prompt cursor and the policy version (PPO updates applied so far). It is
opened by :func:`stages.floor.opening.open_session` (from the last committed checkpoint, a fork's
parent, the SFT policy or the initial model) and closed by :meth:`RLSession.close` (its rollout engine,
a vLLM process, stops; its scorers are freed). It changes only through this module's functions
(:func:`advance_policy`, :func:`seal_update`, :func:`set_prompt_cursor`, :func:`engine_held`),
:func:`stages.floor.checkpoint.save_checkpoint` and, restoring a checkpoint, :mod:`stages.floor.opening`;
``tests/stages/test_structure.py`` holds that line.

Where the Prefect task shells find it: Prefect tasks take the run context and URIs, never models, so
the loop (:func:`flows.rl.rl_iterations`) binds a :class:`SessionSlot` for its run in a context
variable (:func:`bound`) around its stage calls; the ``init_rl_state`` task fills it, each RL task shell
looks the session up once (:func:`session_of`, checked against the run id) and passes it to its body.
A context variable follows the loop into Prefect's task runs (copied contexts) and into the ahead
rollout's worker thread (the loop runs it in a copied context); each rank of an SPMD job binds its own.

With ``trainer.rollout_ahead=1`` the loop saves a checkpoint after iteration i only once iteration
i+1's rollout (sampled from policy i beside update i) is committed, so the checkpoint never depends on
a rollout still to come; the engine keeps its version meanwhile (:func:`engine_held`,
:func:`rollout_version`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stages.floor.scorers import build_scorers
from verl_core.algorithms import KLController
from verl_core.config import RewardConfig, SandboxConfig, canonical_json
from verl_core.models.packed import PackedCausalLM, PackedScoreModel
from verl_core.reward import WeightedScorer
from verl_core.rollout import RolloutEngine
from verl_core.rollout.placement import GroupMemberEngine
from verl_core.runtime.heap import restore_heap, trim_heap
from verl_core.runtime.ranks import barrier
from verl_core.runtime.run import RunContext
from verl_core.store import Manifest
from verl_core.training.distributed import policy_weights
from verl_core.training.engine import TrainEngine
from verl_core.training.ppo import PPOModels
from verl_core.training.ppo_kernels import LogProbModel


@dataclass
class RLSession:
    """One run's RL session. Stages and flows read it; it changes only through this module's
    functions and :func:`stages.floor.checkpoint.save_checkpoint`."""

    run_id: str
    lm: nn.Module  # the HF (or PEFT) policy
    actor: PackedCausalLM
    actor_engine: TrainEngine
    ref: LogProbModel | None  # None without KL; a LoRA actor's is the base with adapters disabled
    critic: PackedScoreModel | None
    critic_engine: TrainEngine | None
    tokenizer: Any
    engine: RolloutEngine
    kl_ctrl: KLController
    version: int  # PPO updates applied = the iteration whose rollout comes next
    iterations: int  # the RL iterations the run plans (the loop's length, the LR schedule's)
    lineage: str  # identity of the starting weights (SFT manifest sha or the initial policy)
    device: torch.device
    prompt_cursor: int = 0  # position in the prompt stream of the next generation batch (checkpointed)
    pending: list[Manifest] = field(default_factory=list)  # sealed updates, published with the next ckpt
    rollout_ahead: int = 0  # trainer.rollout_ahead: iteration i's rollout samples policy max(0, i - this)
    sync_held: bool = False  # an ahead rollout samples the engine: syncs wait for the iteration boundary
    fork_start: str | None = None  # a fork: the identity it started from (its checkpoints record it)
    built_scorers: dict[str, list[WeightedScorer]] = field(default_factory=dict)  # sections' JSON → scorers

    def scorers(self, reward: RewardConfig, sandbox: SandboxConfig) -> list[WeightedScorer]:
        """The scorers of ``reward`` (and ``sandbox``), built on the session's first call and reused
        until it closes: a ``model`` scorer loads its weights once, not every iteration. Keyed by the
        two sections' JSON, so another reward config gets its own. The cost: a reward model stays on
        ``reward.model_device`` through the whole loop, updates included; size the device for it."""
        key = canonical_json([reward.model_dump(mode="json"), sandbox.model_dump(mode="json")])
        if key not in self.built_scorers:
            self.built_scorers[key] = build_scorers(reward, sandbox)
        return self.built_scorers[key]

    def close(self) -> None:
        """Free the scorers (a reward model's weights go with them), close the rollout engine (a
        vLLM engine's process stops here) and give glibc's heap its defaults back."""
        self.built_scorers.clear()
        self.engine.close()
        restore_heap()


class SessionSlot:
    """Where one loop's task shells find its run's session: bound by the loop before its first stage
    (:func:`bound`), filled by the ``init_rl_state`` task (:meth:`fill`)."""

    def __init__(self, run_id: str, session: RLSession | None = None) -> None:
        self.run_id = run_id
        self.session = session

    def fill(self, session: RLSession) -> RLSession:
        if session.run_id != self.run_id:
            raise RuntimeError(f"the RL session of run {session.run_id!r} in run {self.run_id!r}'s slot")
        self.session = session
        return session

    def opened(self) -> RLSession:
        """The session the slot holds (raises before the init task opened it)."""
        if self.session is None:
            raise RuntimeError(f"the RL session of run {self.run_id!r} is not open (init_rl_state opens it)")
        return self.session

    def close(self) -> None:
        """Close the session the slot holds, if one was opened."""
        session, self.session = self.session, None
        if session is not None:
            session.close()


_BOUND: ContextVar[SessionSlot | None] = ContextVar("verl_flow_rl_session", default=None)


@contextmanager
def bound(target: RLSession | str) -> Iterator[SessionSlot]:
    """``with bound(run_id) as slot:`` (the loop: an empty slot the init task fills) or
    ``with bound(session):`` (an open session: tests, benchmarks): the RL task shells of this context
    find it. Closes nothing; the caller closes the session (:meth:`SessionSlot.close`)."""
    slot = SessionSlot(target) if isinstance(target, str) else SessionSlot(target.run_id, target)
    token = _BOUND.set(slot)
    try:
        yield slot
    finally:
        _BOUND.reset(token)


def slot_of(ctx: RunContext) -> SessionSlot:
    """The slot bound for run ``ctx.run_id`` (:func:`bound`)."""
    slot = _BOUND.get()
    if slot is None or slot.run_id != ctx.run_id:
        held = "none" if slot is None else repr(slot.run_id)
        raise RuntimeError(
            f"no RL session is bound for run {ctx.run_id!r} (bound: {held}); the RL stages run inside "
            "the RL loop (flows.rl.rl_iterations), or inside `with bound(open_session(...))`"
        )
    return slot


def session_of(ctx: RunContext) -> RLSession:
    """The open session of run ``ctx.run_id``: the one lookup of an RL task shell."""
    return slot_of(ctx).opened()


def loop_scorers(ctx: RunContext, reward: RewardConfig, sandbox: SandboxConfig) -> list[WeightedScorer]:
    """The reward stage's scorers: its RL session's (built once per loop) inside the loop; built for
    this call alone outside one (a reward stage run on its own)."""
    slot = _BOUND.get()
    if slot is not None and slot.run_id == ctx.run_id and slot.session is not None:
        return slot.session.scorers(reward, sandbox)
    return build_scorers(reward, sandbox)


def sync_rollout_weights(session: RLSession) -> float:
    """Give the rollout engine the policy of ``session.version`` (the weight-sync contract of
    :mod:`verl_core.rollout.base`); returns the seconds it took (``timing_s/weight_sync``).

    An engine sharing the live module only records the version. Otherwise it receives the full
    weights (:func:`verl_core.training.distributed.policy_weights`) or, for a LoRA policy, the
    adapter's weights. Under SPMD every rank must call this: gathering an FSDP2-sharded policy is a
    collective; only the ranks that own an engine keep the gathered weights (a
    :class:`GroupMemberEngine` records the version alone).

    While ``session.sync_held`` (an ahead rollout is sampling the engine's version, :func:`engine_held`)
    nothing happens and 0.0 is returned: the sync waits for the iteration boundary."""
    if session.sync_held:
        return 0.0
    t0 = time.perf_counter()
    engine, lm = session.engine, session.lm
    if engine.shares_weights:
        engine.wake_up()
        engine.update_weights(lm, session.version)
        return time.perf_counter() - t0
    weights = policy_weights(lm, keep=not isinstance(engine, GroupMemberEngine))  # SPMD: a collective
    lora = hasattr(lm, "peft_config")
    if lora and weights:
        from peft import get_peft_model_state_dict

        weights = get_peft_model_state_dict(lm, state_dict=weights)
    # the update's peak stays reserved by torch's caching allocator: hand it back before vLLM wakes
    # (after rest_engine) and maps its weights and KV cache again, on every rank of the engine's group
    # (a tensor-parallel engine wakes on its group members' devices too)
    release_cached_memory()
    barrier()
    engine.wake_up()
    if lora:
        engine.load_adapter(weights, session.version)
    else:
        engine.load_weights(weights.items(), session.version)
    return time.perf_counter() - t0


def release_cached_memory() -> None:
    """Free Python's garbage and return the CUDA caching allocator's unused blocks to the driver
    (nothing on a process that never initialised CUDA), and glibc's freed heap to the OS
    (:func:`verl_core.runtime.heap.trim_heap`): the session keeps what an update frees for its next
    micro-batch (:func:`~verl_core.runtime.heap.retain_freed_heap`), so without the trim a CPU trainer
    holds the update's high-water mark through weight sync and generation."""
    import gc

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    trim_heap()


def rest_engine(session: RLSession) -> None:
    """Before the update's training: a rollout engine holding its own weights frees the accelerator
    (vLLM's sleep mode where the platform has it: weights offloaded, KV cache dropped; elsewhere a
    no-op) until :func:`sync_rollout_weights` wakes it to load the new policy. Not while an ahead
    rollout samples it (:func:`engine_held`), nor for an engine sampling the trainer's own module."""
    if not session.sync_held and not session.engine.shares_weights:
        session.engine.sleep()


def advance_policy(session: RLSession, iteration: int) -> float:
    """After update ``iteration``: the policy in memory is version ``iteration + 1``, and the rollout
    engine receives it (:func:`sync_rollout_weights`; every rank of an SPMD job must call this).
    Returns the sync's seconds (``timing_s/weight_sync``)."""
    session.version = iteration + 1
    return sync_rollout_weights(session)


def seal_update(session: RLSession, manifest: Manifest) -> None:
    """Leave a sealed update manifest pending: :func:`stages.floor.checkpoint.save_checkpoint`
    publishes it with the checkpoint that makes its weights durable."""
    session.pending.append(manifest)


def set_prompt_cursor(session: RLSession, cursor: int) -> None:
    """Where the next generation batch takes its prompts in the prompt stream (checkpointed)."""
    session.prompt_cursor = cursor


def rollout_version(session: RLSession, iteration: int) -> int:
    """The policy version iteration ``iteration``'s rollout samples: ``iteration`` on-policy, one
    behind with ``trainer.rollout_ahead=1`` (generated while update ``iteration - 1`` runs); iteration 0
    has no ahead rollout (version 0)."""
    return max(0, iteration - session.rollout_ahead)


@contextmanager
def engine_held(session: RLSession) -> Iterator[None]:
    """``with engine_held(session): <ahead rollout ∥ update>``: the rollout engine keeps its weights
    and version while the trainer moves on (:func:`sync_rollout_weights` does nothing inside); the
    caller syncs after the block, at the iteration boundary, once the ahead rollout has finished."""
    session.sync_held = True
    try:
        yield
    finally:
        session.sync_held = False


def ppo_models(session: RLSession) -> PPOModels:
    """The models one PPO iteration reads and trains."""
    return PPOModels(
        session.actor,
        session.actor_engine,
        session.ref,
        session.critic,
        session.critic_engine,
        session.device,
    )
