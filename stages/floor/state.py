"""The RL loop's state: its models, kept in memory for the whole loop in local mode, and the
checkpoint protocol.

``RLState`` holds the actor (and its optimizer), the reference policy, the critic (and its optimizer),
the rollout engine, the KL controller and the policy version (PPO updates applied so far). Stage
tasks look it up by run id; when it is missing (a fresh process, a resumed run) it is rebuilt from
the artifacts: the last committed checkpoint ``ckpt/iter-XXXX`` or the SFT policy.

Checkpoints hold the policy (HF dir or LoRA adapter), the critic, optimizer/scheduler states, the KL
controller, RNG states, the iteration and the prompt cursor (where the next generation batch takes
its prompts: dynamic sampling takes a varying number of batches per iteration); the last
``trainer.max_ckpt_to_keep`` are kept.

Update stages commit with the next checkpoint. A ``ppo_update`` moves the in-memory weights to the
next version, and those weights become durable only when a checkpoint is saved; so the update seals
its manifest (its files are written) and leaves it *pending* in the state. :func:`save_checkpoint`
records the pending manifests in the checkpoint (``pending/…``) and publishes them right after the
checkpoint's own commit; :func:`init_state` publishes any the process did not get to (killed between
the two). Hence a committed update is always recoverable, and a rerun never runs a committed stage
again. The price is visibility, not disk: ``iter-XXXX/update`` of an iteration appears with the next
checkpoint (``trainer.save_freq``), while rollouts, rewards and validations appear at once. Storing
the new weights in every update instead would cost a full policy + critic + optimizer state per
iteration.

With ``trainer.rollout_ahead=1`` the loop saves a checkpoint after iteration i only once iteration
i+1's rollout (sampled from policy i beside update i) is committed, so the checkpoint never depends on
a rollout still to come; the engine keeps its version meanwhile (:func:`engine_held`,
:func:`rollout_version`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from stages.floor.artifacts import files_under, load_tokenizer, read_policy, write_policy
from stages.floor.engines import build_rollout_engine
from stages.floor.locations import ckpt_stage, list_checkpoints, validations
from stages.floor.logging import stage_logger
from stages.floor.parent import FORK_START, ForkStart, fork_start
from stages.floor.policy import build_policy, load_reference, mixed_precision
from stages.floor.scorers import drop_scorers
from stages.floor.specs import actor_spec, critic_spec, iteration_count, planned_iterations
from verl_core.algorithms import KLController, make_kl_controller
from verl_core.config import VerlFlowConfig, canonical_json
from verl_core.errors import ArtifactNotFoundError, ConfigError
from verl_core.files import write_files
from verl_core.models.checkpoint import (
    load_state,
    rng_state,
    save_state,
    saved_model,
    seed_rngs,
    set_rng_state,
)
from verl_core.models.heads import load_value_model, value_model_from_policy
from verl_core.models.loading import enable_gradient_checkpointing, resolve_device
from verl_core.models.packed import PackedCausalLM, PackedScoreModel
from verl_core.rollout import RolloutEngine
from verl_core.rollout.placement import GroupMemberEngine
from verl_core.runtime.ranks import barrier, distributed, on_main, rank0_to_main
from verl_core.runtime.run import RunContext
from verl_core.runtime.run_length import StepCount
from verl_core.seeding import derive_seed
from verl_core.store import ArtifactStore, Manifest
from verl_core.training.engine import TrainEngine
from verl_core.training.ppo import PPOModels
from verl_core.training.ppo_kernels import AdapterDisabledPolicy, LogProbModel
from verl_core.training.strategies import build_train_engine, full_weights, prepare_frozen

PENDING = "pending"  # checkpoint files holding the manifests of updates it publishes


@dataclass
class RLState:
    """One run's RL state. Stages and flows read it; it changes only through this module's functions
    (:func:`advance_policy`, :func:`seal_update`, :func:`set_prompt_cursor`, :func:`engine_held`,
    :func:`save_checkpoint`), which ``tests/stages/test_structure.py`` holds."""

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


_STATES: dict[str, RLState] = {}


def get_state(ctx: RunContext) -> RLState:
    try:
        return _STATES[ctx.run_id]
    except KeyError:
        raise RuntimeError(
            f"the RL state of run {ctx.run_id!r} is not loaded (call init_state first)"
        ) from None


def drop_state(run_id: str) -> None:
    """Forget the run's RL state and its scorers, close its rollout engine (a vLLM engine's process
    stops here)."""
    drop_scorers(run_id)
    state = _STATES.pop(run_id, None)
    if state is not None:
        state.engine.close()


def init_state(ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None) -> int:
    """Build the RL state (from a checkpoint per ``trainer.resume_mode``, else the SFT policy or the
    initial model); returns the iteration to start from."""
    store = ctx.store()
    tokenizer = load_tokenizer(store, template_pack_uri)
    device = resolve_device(cfg.trainer.device)
    seed_rngs(cfg.trainer.seed)
    resume = _resume_iteration(store, ctx.run_id, cfg.trainer.resume_mode)
    own = store.committed(ctx.run_id, ckpt_stage(resume)) if resume is not None else None
    fork = fork_start(store, cfg.parent, own) if cfg.parent is not None else None  # stages.floor.parent
    lineage = policy_lineage(cfg, start_identity(store, sft_uri, fork))
    if own is not None and own.summary.get("lineage") != lineage:
        raise ConfigError(
            f"trainer.resume_mode: checkpoint {own.stage} of run {ctx.run_id!r} was made with other "
            "settings or another SFT policy; use a new run id, or trainer.resume_mode=disable to restart RL"
        )
    # a fork starts from its parent's checkpoint, and resumes from its own once it has one
    ckpt = own if own is not None or fork is None else fork.checkpoint
    if ckpt is not None:
        lm = read_policy(store, ckpt, "policy", cfg.model)
    elif sft_uri:
        lm = read_policy(store, store.read_manifest(sft_uri), "policy", cfg.model)
    else:
        lm = build_policy(cfg.model, tokenizer, seed=cfg.trainer.seed)
    ref: LogProbModel | None = None
    attention, compiled = cfg.model.packed_attention, cfg.model.torch_compile
    actor = PackedCausalLM(lm, attention=attention, compile_layers=compiled)
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        if cfg.ref.path:  # a reference other than the starting policy
            ref = PackedCausalLM(load_reference(cfg, lm), attention=attention, compile_layers=compiled)
        elif cfg.model.lora_rank:  # the base with the adapters disabled
            ref = AdapterDisabledPolicy(actor, lm)
        else:  # the starting policy (SFT, or the initial model), frozen; a fork's: its root run's
            if fork is not None and fork.reference_sft is not None:
                frozen = read_policy(store, fork.reference_sft, "policy", cfg.model)
            elif fork is not None:
                frozen = build_policy(fork.reference_model, tokenizer, seed=fork.reference_seed)
            elif sft_uri:
                frozen = read_policy(store, store.read_manifest(sft_uri), "policy", cfg.model)
            else:
                frozen = build_policy(cfg.model, tokenizer, seed=cfg.trainer.seed)
            ref = PackedCausalLM(
                frozen.eval().requires_grad_(False), attention=attention, compile_layers=compiled
            )
    iterations = planned_iterations(cfg, train_prompts(store, template_pack_uri))
    critic = critic_engine = None
    if cfg.use_critic:  # before the actor is sharded: a new critic copies the policy's backbone
        made = _critic(cfg, store, ckpt, lm, own=own is not None)
        critic = PackedScoreModel(made, attention=attention, compile_layers=compiled)
    if isinstance(ref, PackedCausalLM):
        ref = prepare_frozen(
            ref, cfg.ref.strategy, device, param_offload=cfg.ref.param_offload,
            mixed_precision=mixed_precision(cfg.ref.mixed_precision),
        )  # fmt: skip
    # the rollout engine before the actor is sharded: an own-copy engine copies the whole policy
    engine = build_rollout_engine(cfg, lm, tokenizer, device)  # this rank's (placement)
    try:  # a failure from here on leaves no engine (a vLLM subprocess) behind
        a = cfg.actor
        actor_engine = build_train_engine(
            actor, actor_spec(cfg, iterations), strategy=a.strategy, device=device, zero_stage=a.zero_stage,
            param_offload=a.param_offload, tp_size=a.tensor_parallel_size,
            mixed_precision=mixed_precision(a.mixed_precision),
        )  # fmt: skip
        if critic is not None:
            c = cfg.critic
            critic_engine = build_train_engine(
                critic, critic_spec(cfg, iterations), strategy=c.strategy, device=device,
                zero_stage=c.zero_stage, param_offload=c.param_offload,
                mixed_precision=mixed_precision(c.mixed_precision), role="critic",
            )  # fmt: skip
        kl = cfg.algorithm.kl_ctrl
        kl_ctrl = make_kl_controller(kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)
        version = 0
        cursor = 0
        if ckpt is not None:
            with store.local_file(ckpt, "trainer_state.pt") as path:  # memory-mapped, not read whole
                state = load_state(path, store.file_uri(ckpt, "trainer_state.pt"))
            actor_engine.load_state_dict(state["actor"])
            if critic_engine is not None and state["critic"]:  # a fork may add a critic
                critic_engine.load_state_dict(state["critic"])
            if own is None:  # a fork: the parent's moments and step, its own learning rates
                for e in (actor_engine, critic_engine):
                    if isinstance(e, TrainEngine):
                        e.use_spec_lr()
            kl_ctrl.load_state_dict(state["kl_ctrl"])
            set_rng_state(state["rng"])
            version = int(state["iteration"])
            cursor = int(state["prompt_cursor"])
            if own is not None:
                on_main(lambda: publish_pending(store, own))
            where = "" if own is not None else f" of run {ckpt.run_id} (fork)"
            stage_logger(__name__).info("rl: resumed from checkpoint at iteration %d%s", version, where)
        rl = _STATES[ctx.run_id] = RLState(
            run_id=ctx.run_id,
            lm=lm,
            actor=actor,
            actor_engine=actor_engine,
            ref=ref,
            critic=critic,
            critic_engine=critic_engine,
            tokenizer=tokenizer,
            engine=engine,
            kl_ctrl=kl_ctrl,
            version=version,
            iterations=iterations,
            lineage=lineage,
            device=device,
            prompt_cursor=cursor,
            rollout_ahead=cfg.trainer.rollout_ahead,
            fork_start=fork.identity if fork is not None else None,
        )
        seconds = sync_rollout_weights(rl)  # the engine holds the loaded policy, as version `version`
    except BaseException:
        _STATES.pop(ctx.run_id, None)
        engine.close()
        raise
    stage_logger(__name__).info("rl: rollout engine at policy version %d (sync %.2f s)", version, seconds)
    return version


def train_prompts(store: ArtifactStore, template_pack_uri: str) -> int:
    """Number of training prompts template_pack wrote (from its manifest summary)."""
    return int(store.read_manifest(template_pack_uri).summary["rows"]["prompts_train"])


def start_identity(store: ArtifactStore, sft_uri: str | None, fork: ForkStart | None) -> str | None:
    """The start of a run's policy lineage: a fork's parent checkpoint (:class:`ForkStart`), else the
    SFT manifest's hash, else None (the initial model)."""
    if fork is not None:
        return fork.identity
    return store.manifest_sha256(sft_uri) if sft_uri else None


def policy_lineage(cfg: VerlFlowConfig, start_sha: str | None) -> str:
    """Identity of the policy trajectory: the starting weights (SFT manifest hash, or the initial
    model) and every setting that changes what the policy becomes. Iteration i's policy is a function
    of this and i (fixed seeds), so stages keyed by (lineage, i) can be skipped on rerun."""
    shaping = {
        k: cfg.section_without_placement(k)
        for k in ("data", "model", "actor", "critic", "ref", "rollout", "reward", "algorithm")
    }
    shaping["trainer"] = {
        "seed": cfg.trainer.seed,
        "critic_warmup": cfg.trainer.critic_warmup,
        "total_iterations": cfg.trainer.total_iterations,
        "total_epochs": cfg.trainer.total_epochs,  # caps the iterations, sets the LR schedule
    }
    if cfg.trainer.rollout_ahead:  # which policy samples each batch (absent when 0: older lineages hold)
        shaping["trainer"]["rollout_ahead"] = cfg.trainer.rollout_ahead
    shaping["start"] = start_sha or "initial-model"
    return hashlib.sha256(canonical_json(shaping).encode()).hexdigest()


def save_checkpoint(ctx: RunContext, cfg: VerlFlowConfig, iteration: int) -> str:
    """Commit ``ckpt/iter-XXXX`` for the in-memory state and prune old checkpoints."""
    state = get_state(ctx)
    store = ctx.store()
    # every rank: the full (unsharded) weights and optimizer states, gathered to rank 0 in an SPMD job
    policy = full_weights(state.actor_engine, "lm.")
    critic = None if state.critic_engine is None else full_weights(state.critic_engine, "model.")
    engines = {
        "actor": state.actor_engine.state_dict(),
        "critic": state.critic_engine.state_dict() if state.critic_engine is not None else {},
    }  # full optimizer states, on global rank 0
    trainer_state = {
        **(rank0_to_main(engines) or {}),
        "kl_ctrl": state.kl_ctrl.state_dict(),
        "rng": rng_state(),
        "iteration": iteration,
        "prompt_cursor": state.prompt_cursor,
    }

    def commit() -> str:  # rank 0 writes
        where = ckpt_stage(iteration)
        stage = store.open_stage(ctx.run_id, where, params={"iteration": iteration}, force=True)
        write_policy(stage, "policy", state.lm, state.tokenizer, cfg.model, state_dict=policy)
        if state.critic is not None:
            with saved_model(state.critic.model, state_dict=critic) as files:  # 2 GB at 0.5B: streamed
                for name, path in files.items():
                    stage.write_bytes(f"critic/{name}", path)
        with stage.staged_file("trainer_state.pt") as path:  # GBs of moments: streamed, never one bytes
            save_state(trainer_state, path)
        for m in state.pending:  # updates whose weights this checkpoint makes durable
            stage.write_bytes(f"{PENDING}/{m.stage}.json", m.to_bytes())
        pending = [m.stage for m in state.pending]
        summary = {"iteration": iteration, "planned_iterations": state.iterations, "lineage": state.lineage}
        if state.fork_start is not None:  # a fork resumes from its own checkpoints, its parent's pruned
            summary[FORK_START] = state.fork_start
        uri = stage.commit(summary={**summary, "pending": pending})
        publish_pending(store, store.read_manifest(uri))
        for old in list_checkpoints(store, ctx.run_id)[: -cfg.trainer.max_ckpt_to_keep]:
            store.delete_stage(ctx.run_id, ckpt_stage(old))
        return uri

    uri = on_main(commit)
    state.pending.clear()
    return uri


def publish_pending(store: ArtifactStore, ckpt: Manifest) -> list[str]:
    """Publish the update manifests a checkpoint recorded as pending and that are not committed yet
    (their files were written before the checkpoint); returns the stages published."""
    published = []
    for entry in ckpt.files:
        if not entry.name.startswith(f"{PENDING}/"):
            continue
        where = store.file_uri(ckpt, entry.name)
        manifest = Manifest.from_bytes(store.read_bytes(ckpt, entry.name), where=where)
        if store.committed(manifest.run_id, manifest.stage) is not None:
            continue
        if not store.files_present(manifest):
            raise ArtifactNotFoundError(
                f"{where}: the files of pending stage {manifest.stage!r} "
                f"(attempt {manifest.attempt}) are gone"
            )
        store.publish(manifest)
        published.append(manifest.stage)
    return published


def _resume_iteration(store: ArtifactStore, run_id: str, mode: str) -> int | None:
    if mode == "disable":
        return None
    available = list_checkpoints(store, run_id)
    if mode == "auto":
        return available[-1] if available else None
    wanted = int(mode)
    if wanted not in available:
        raise ConfigError(
            f"trainer.resume_mode: no checkpoint at iteration {wanted} in run {run_id!r} "
            f"(available: {', '.join(map(str, available)) or 'none'})"
        )
    return wanted


def _critic(
    cfg: VerlFlowConfig, store: ArtifactStore, ckpt: Manifest | None, lm: nn.Module, *, own: bool
) -> nn.Module:
    """The checkpoint's critic; a new one when there is no checkpoint, or a fork's parent had none.
    ``model.gradient_checkpointing`` recomputes its activations in backward as it does the policy's."""
    import tempfile

    files = files_under(store, ckpt, "critic") if ckpt is not None else {}
    if ckpt is not None and not files and own:
        raise ArtifactNotFoundError(f"checkpoint {ckpt.stage} of run {ckpt.run_id} has no critic")
    if files:
        with tempfile.TemporaryDirectory() as tmp:
            critic = load_value_model(str(write_files(files, tmp)), dtype=cfg.model.dtype)
    elif cfg.critic.path:
        critic = load_value_model(
            cfg.critic.path, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
        )
    else:
        critic = value_model_from_policy(lm, seed=derive_seed("critic_head", cfg.trainer.seed))
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(critic)
    return critic


@dataclass(frozen=True)
class RLResult:
    """What the RL loop leaves: its last checkpoint's manifest URI, the held-out accuracy of the
    policy after each validated iteration (0: before RL), and seconds spent per phase."""

    checkpoint: str
    val_accuracy: dict[int, float]
    iterations: StepCount  # planned vs completed
    timing_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (how an SPMD job's rank 0 hands it to the launching flow)."""
        val = {str(k): v for k, v in self.val_accuracy.items()}
        return {
            "checkpoint": self.checkpoint,
            "val_accuracy": val,
            "timing_s": self.timing_s,
            "iterations": self.iterations.model_dump(mode="json"),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RLResult:
        return cls(
            checkpoint=data["checkpoint"],
            val_accuracy={int(k): float(v) for k, v in data["val_accuracy"].items()},
            iterations=StepCount.model_validate(data["iterations"]),
            timing_s={k: float(v) for k, v in data["timing_s"].items()},
        )


def committed_rl_result(
    store: ArtifactStore, run_id: str, cfg: VerlFlowConfig, sft_uri: str | None
) -> RLResult | None:
    """The RL loop's result rebuilt from the store (after its flow ran elsewhere): the last committed
    checkpoint and the validations of this policy lineage; None without a checkpoint. No timings."""
    ckpts = list_checkpoints(store, run_id)
    last = store.committed(run_id, ckpt_stage(ckpts[-1])) if ckpts else None
    if last is None:
        return None
    fork = fork_start(store, cfg.parent, last) if cfg.parent is not None else None
    lineage = policy_lineage(cfg, start_identity(store, sft_uri, fork))
    count = iteration_count(cfg, int(last.summary["planned_iterations"]), ckpts[-1])
    uri = store.manifest_uri(run_id, ckpt_stage(ckpts[-1]))
    return RLResult(uri, validations(store, run_id, lineage), iterations=count)


def completed_iterations(ctx: RunContext, cfg: VerlFlowConfig) -> StepCount:
    """The loaded RL state's planned vs completed iterations (completed: PPO updates the policy holds,
    those restored from a checkpoint included)."""
    state = get_state(ctx)
    return iteration_count(cfg, state.iterations, state.version)


def sync_rollout_weights(state: RLState) -> float:
    """Give the rollout engine the policy of ``state.version`` (the weight-sync contract of
    :mod:`verl_core.rollout.base`); returns the seconds it took (``timing_s/weight_sync``).

    An engine sharing the live module only records the version. Otherwise it receives the full
    weights (:func:`policy_weights`) or, for a LoRA policy, the adapter's weights. Under SPMD every
    rank must call this: gathering an FSDP2-sharded policy is a collective; only the ranks that own
    an engine keep the gathered weights (a :class:`GroupMemberEngine` records the version alone).

    While ``state.sync_held`` (an ahead rollout is sampling the engine's version, :func:`engine_held`)
    nothing happens and 0.0 is returned: the sync waits for the iteration boundary."""
    if state.sync_held:
        return 0.0
    t0 = time.perf_counter()
    engine, lm = state.engine, state.lm
    if engine.shares_weights:
        engine.wake_up()
        engine.update_weights(lm, state.version)
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
        engine.load_adapter(weights, state.version)
    else:
        engine.load_weights(weights.items(), state.version)
    return time.perf_counter() - t0


def release_cached_memory() -> None:
    """Free Python's garbage and return the CUDA caching allocator's unused blocks to the driver
    (nothing on a process that never initialised CUDA), and glibc's freed heap to the OS: glibc keeps
    freed blocks under its mmap threshold (which rises to 32 MiB as larger tensors are freed, so a
    0.5B model's activations and gradients) resident until ``malloc_trim``; without it a CPU
    trainer holds the update's high-water mark through weight sync and generation."""
    import contextlib
    import ctypes
    import gc
    import sys

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl has no malloc_trim)
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def rest_engine(state: RLState) -> None:
    """Before the update's training: a rollout engine holding its own weights frees the accelerator
    (vLLM's sleep mode where the platform has it: weights offloaded, KV cache dropped; elsewhere a
    no-op) until :func:`sync_rollout_weights` wakes it to load the new policy. Not while an ahead
    rollout samples it (:func:`engine_held`), nor for an engine sampling the trainer's own module."""
    if not state.sync_held and not state.engine.shares_weights:
        state.engine.sleep()


def advance_policy(state: RLState, iteration: int) -> float:
    """After update ``iteration``: the policy in memory is version ``iteration + 1``, and the rollout
    engine receives it (:func:`sync_rollout_weights`; every rank of an SPMD job must call this).
    Returns the sync's seconds (``timing_s/weight_sync``)."""
    state.version = iteration + 1
    return sync_rollout_weights(state)


def seal_update(state: RLState, manifest: Manifest) -> None:
    """Leave a sealed update manifest pending: :func:`save_checkpoint` publishes it with the
    checkpoint that makes its weights durable."""
    state.pending.append(manifest)


def set_prompt_cursor(state: RLState, cursor: int) -> None:
    """Where the next generation batch takes its prompts in the prompt stream (checkpointed)."""
    state.prompt_cursor = cursor


def rollout_version(state: RLState, iteration: int) -> int:
    """The policy version iteration ``iteration``'s rollout samples: ``iteration`` on-policy, one
    behind with ``trainer.rollout_ahead=1`` (generated while update ``iteration - 1`` runs); iteration 0
    has no ahead rollout (version 0)."""
    return max(0, iteration - state.rollout_ahead)


@contextmanager
def engine_held(state: RLState) -> Iterator[None]:
    """``with engine_held(state): <ahead rollout ∥ update>``: the rollout engine keeps its weights and
    version while the trainer moves on (:func:`sync_rollout_weights` does nothing inside); the caller
    syncs after the block, at the iteration boundary, once the ahead rollout has finished."""
    state.sync_held = True
    try:
        yield
    finally:
        state.sync_held = False


def policy_weights(lm: nn.Module, *, keep: bool = True) -> dict[str, Tensor]:
    """The policy's full state dict (names of ``lm.state_dict()``) for a rollout engine holding its own
    weights. One process: the plain state dict (as it is; DeepSpeed's gathered, cloned).

    Sharded (FSDP2 / TP parameters are DTensors, DeepSpeed ZeRO-3 partitions) every rank must call
    (all-gathers). The full tensors are gathered one at a time, each moved to the CPU as it arrives
    and kept only where ``keep`` (the ranks that own an engine; the others get ``{}``): one CPU copy
    per engine, and no rank ever holds more than one full tensor on its device. The engine stages
    them from there (:mod:`verl_core.rollout.weight_sync`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    if any(hasattr(p, "ds_id") for p in lm.parameters()):  # DeepSpeed ZeRO-3 partitions
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(lm.parameters())):
            if not distributed():
                return {k: v.detach().clone() for k, v in lm.state_dict().items()}
            return {k: v.detach().to("cpu", copy=True) for k, v in lm.state_dict().items()} if keep else {}
    sharded = any(isinstance(p, DTensor) for p in lm.parameters())
    if not sharded and not distributed():
        return lm.state_dict()
    state = get_model_state_dict(lm, options=StateDictOptions(full_state_dict=False))
    # tied weights are gathered once, decided by the module's structure (the same on every rank: each
    # gather is a collective); the state dict's tensors are distinct objects even where tied
    first_name: dict[str, str] = {}
    by_param: dict[int, str] = {}
    for pname, param in lm.named_parameters(remove_duplicate=False):
        first_name[pname] = by_param.setdefault(id(param), pname)
    out: dict[str, Tensor] = {}
    gathered: set[str] = set()
    for name, value in state.items():
        if not isinstance(value, Tensor):
            continue
        source = first_name.get(name, name)
        if source in gathered:
            if keep:
                out[name] = out[source]
            continue
        gathered.add(name)
        if isinstance(value, DTensor):
            # a collective on the mesh's device: an offloaded (CPU) shard moves there first, as in
            # torch's own full state dict (torch.distributed._state_dict_utils._gather_state_dict)
            mesh = value.device_mesh.device_type
            full = (value if value.device.type == mesh else value.to(mesh)).full_tensor()
        else:
            full = value.detach()
        if keep:
            out[name] = full.to("cpu", copy=True)
        del full
    return out


def ppo_models(state: RLState) -> PPOModels:
    """The models one PPO iteration reads and trains."""
    return PPOModels(
        state.actor, state.actor_engine, state.ref, state.critic, state.critic_engine, state.device
    )
