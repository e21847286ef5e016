"""Opening an RL session (:class:`stages.floor.session.RLSession`): where the policy starts, which
reference it is held to, and its engines.

The start point, in order: the run's own last committed checkpoint (per ``trainer.resume_mode``), a
fork's parent checkpoint (``parent``), the SFT policy, the initial model. The reference (with a KL
term): ``ref.path`` when set, a LoRA policy's own base with the adapters disabled, else the starting
policy frozen (a fork's: its root run's). Then the critic, the rollout engine (before the actor is
sharded: an own-copy engine copies the whole policy) and the actor's and critic's train engines; a
checkpoint restores the optimizers, the KL controller, the RNG states, the version and the prompt
cursor, and publishes the update manifests it recorded as pending.
"""

from __future__ import annotations

from torch import nn

from stages.floor.artifacts import load_tokenizer, local_model_dir, read_policy
from stages.floor.checkpoint import publish_pending, resume_iteration
from stages.floor.engines import build_rollout_engine
from stages.floor.lineage import policy_lineage, start_identity
from stages.floor.locations import ckpt_stage
from stages.floor.logging import stage_logger
from stages.floor.parent import ForkStart, fork_start
from stages.floor.policy import build_policy, load_reference, mixed_precision
from stages.floor.session import RLSession, sync_rollout_weights
from stages.floor.specs import actor_spec, critic_spec, planned_iterations
from verl_core.algorithms import make_kl_controller
from verl_core.config import VerlFlowConfig
from verl_core.errors import ArtifactNotFoundError, ConfigError
from verl_core.models.checkpoint import load_state, seed_rngs, set_rng_state
from verl_core.models.heads import load_value_model, value_model_from_policy
from verl_core.models.loading import enable_gradient_checkpointing, resolve_device
from verl_core.models.packed import PackedCausalLM, PackedScoreModel
from verl_core.runtime.heap import restore_heap, retain_freed_heap
from verl_core.runtime.ranks import on_main
from verl_core.runtime.run import RunContext
from verl_core.seeding import derive_seed
from verl_core.store import ArtifactStore, Manifest
from verl_core.training.engine import TrainEngine
from verl_core.training.ppo_kernels import AdapterDisabledPolicy, LogProbModel
from verl_core.training.strategies import build_train_engine, prepare_frozen


def open_session(
    ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, sft_uri: str | None
) -> RLSession:
    """Open run ``ctx.run_id``'s RL session (from a checkpoint per ``trainer.resume_mode``, else a
    fork's parent checkpoint, the SFT policy or the initial model); its ``version`` is the iteration
    the loop starts from. The caller closes it (:meth:`RLSession.close`)."""
    store = ctx.store()
    tokenizer = load_tokenizer(store, template_pack_uri)
    device = resolve_device(cfg.trainer.device)
    seed_rngs(cfg.trainer.seed)
    resume = resume_iteration(store, ctx.run_id, cfg.trainer.resume_mode)
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
    attention, compiled = cfg.model.packed_attention, cfg.model.torch_compile
    actor = PackedCausalLM(lm, attention=attention, compile_layers=compiled)
    ref = _reference(cfg, store, lm, actor, fork, sft_uri, tokenizer)
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
        retain_freed_heap()  # an update's freed tensors serve its next micro-batch (RLSession.close undoes)
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
        session = RLSession(
            run_id=ctx.run_id, lm=lm, actor=actor, actor_engine=actor_engine, ref=ref, critic=critic,
            critic_engine=critic_engine, tokenizer=tokenizer, engine=engine, kl_ctrl=kl_ctrl, version=0,
            iterations=iterations, lineage=lineage, device=device, rollout_ahead=cfg.trainer.rollout_ahead,
            fork_start=fork.identity if fork is not None else None,
        )  # fmt: skip
        if ckpt is not None:
            _restore(session, store, ckpt, own=own)
        seconds = sync_rollout_weights(session)  # the engine holds the loaded policy, as version `version`
    except BaseException:
        engine.close()
        restore_heap()
        raise
    stage_logger(__name__).info(
        "rl: rollout engine at policy version %d (sync %.2f s)", session.version, seconds
    )
    return session


def train_prompts(store: ArtifactStore, template_pack_uri: str) -> int:
    """Number of training prompts template_pack wrote (from its manifest summary)."""
    return int(store.read_manifest(template_pack_uri).summary["rows"]["prompts_train"])


def _reference(
    cfg: VerlFlowConfig,
    store: ArtifactStore,
    lm: nn.Module,
    actor: PackedCausalLM,
    fork: ForkStart | None,
    sft_uri: str | None,
    tokenizer: object,
) -> LogProbModel | None:
    """The reference policy the KL terms hold the actor to; None without a KL term."""
    if not (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        return None
    attention, compiled = cfg.model.packed_attention, cfg.model.torch_compile
    if cfg.ref.path:  # a reference other than the starting policy
        return PackedCausalLM(load_reference(cfg, lm), attention=attention, compile_layers=compiled)
    if cfg.model.lora_rank:  # the base with the adapters disabled
        return AdapterDisabledPolicy(actor, lm)
    # the starting policy (SFT, or the initial model), frozen; a fork's: its root run's
    if fork is not None and fork.reference_sft is not None:
        frozen = read_policy(store, fork.reference_sft, "policy", cfg.model)
    elif fork is not None:
        frozen = build_policy(fork.reference_model, tokenizer, seed=fork.reference_seed)
    elif sft_uri:
        frozen = read_policy(store, store.read_manifest(sft_uri), "policy", cfg.model)
    else:
        frozen = build_policy(cfg.model, tokenizer, seed=cfg.trainer.seed)
    return PackedCausalLM(frozen.eval().requires_grad_(False), attention=attention, compile_layers=compiled)


def _restore(session: RLSession, store: ArtifactStore, ckpt: Manifest, *, own: Manifest | None) -> None:
    """The checkpoint's optimizer states, KL controller, RNG states, version and prompt cursor into the
    session (a fork's: the parent's moments and step, its own learning rates); publishes the updates
    the run's own checkpoint recorded as pending."""
    with store.local_file(ckpt, "trainer_state.pt") as path:  # memory-mapped, not read whole
        state = load_state(path, store.file_uri(ckpt, "trainer_state.pt"))
    session.actor_engine.load_state_dict(state["actor"])
    if session.critic_engine is not None and state["critic"]:  # a fork may add a critic
        session.critic_engine.load_state_dict(state["critic"])
    if own is None:  # a fork: the parent's moments and step, its own learning rates
        for e in (session.actor_engine, session.critic_engine):
            if isinstance(e, TrainEngine):
                e.use_spec_lr()
    session.kl_ctrl.load_state_dict(state["kl_ctrl"])
    set_rng_state(state["rng"])
    session.version = int(state["iteration"])
    session.prompt_cursor = int(state["prompt_cursor"])
    if own is not None:
        on_main(lambda: publish_pending(store, own))
    where = "" if own is not None else f" of run {ckpt.run_id} (fork)"
    stage_logger(__name__).info("rl: resumed from checkpoint at iteration %d%s", session.version, where)


def _critic(
    cfg: VerlFlowConfig, store: ArtifactStore, ckpt: Manifest | None, lm: nn.Module, *, own: bool
) -> nn.Module:
    """The checkpoint's critic; a new one when there is no checkpoint, or a fork's parent had none.
    ``model.gradient_checkpointing`` recomputes its activations in backward as it does the policy's."""
    saved = ckpt is not None and any(f.name.startswith("critic/") for f in ckpt.files)
    if ckpt is not None and not saved and own:
        raise ArtifactNotFoundError(f"checkpoint {ckpt.stage} of run {ckpt.run_id} has no critic")
    if ckpt is not None and saved:
        with local_model_dir(store, ckpt, "critic") as directory:  # the store's files, not read whole
            critic = load_value_model(str(directory), dtype=cfg.model.dtype)
    elif cfg.critic.path:
        critic = load_value_model(
            cfg.critic.path, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
        )
    else:
        critic = value_model_from_policy(lm, seed=derive_seed("critic_head", cfg.trainer.seed))
    if cfg.model.gradient_checkpointing:
        enable_gradient_checkpointing(critic)
    return critic
