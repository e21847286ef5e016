"""The RL loop's checkpoint protocol: ``ckpt/iter-XXXX`` of an open :class:`RLSession`, the update
manifests it makes durable, and the iteration a run resumes from.

Checkpoints hold the policy (HF dir or LoRA adapter), the critic, optimizer/scheduler states, the KL
controller, RNG states, the iteration and the prompt cursor (where the next generation batch takes
its prompts: dynamic sampling takes a varying number of batches per iteration); the last
``trainer.max_ckpt_to_keep`` are kept.

Update stages commit with the next checkpoint. A ``ppo_update`` moves the in-memory weights to the
next version, and those weights become durable only when a checkpoint is saved; so the update seals
its manifest (its files are written) and leaves it *pending* in the session. :func:`save_checkpoint`
records the pending manifests in the checkpoint (``pending/…``) and publishes them right after the
checkpoint's own commit; :func:`stages.floor.opening.open_session` publishes any the process did not
get to (killed between the two). Hence a committed update is always recoverable, and a rerun never runs
a committed stage again. The price is visibility, not disk: ``iter-XXXX/update`` of an iteration appears
with the next checkpoint (``trainer.save_freq``), while rollouts, rewards and validations appear at
once. Storing the new weights in every update instead would cost a full policy + critic + optimizer
state per iteration.
"""

from __future__ import annotations

from stages.floor.artifacts import write_policy
from stages.floor.locations import ckpt_stage, list_checkpoints
from stages.floor.parent import FORK_START
from stages.floor.session import RLSession
from verl_core.config import VerlFlowConfig
from verl_core.errors import ArtifactNotFoundError, ConfigError
from verl_core.models.checkpoint import rng_state, save_state, saved_model
from verl_core.runtime.ranks import on_main, rank0_to_main
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore, Manifest
from verl_core.training.strategies import full_weights

PENDING = "pending"  # checkpoint files holding the manifests of updates it publishes


def save_checkpoint(session: RLSession, ctx: RunContext, cfg: VerlFlowConfig, iteration: int) -> str:
    """Commit ``ckpt/iter-XXXX`` for the session's models and prune old checkpoints. Reads ``model``
    (how the policy is written) and ``trainer.max_ckpt_to_keep``."""
    store = ctx.store()
    # every rank: the full (unsharded) weights and optimizer states, gathered to rank 0 in an SPMD job
    policy = full_weights(session.actor_engine, "lm.")
    critic = None if session.critic_engine is None else full_weights(session.critic_engine, "model.")
    engines = {
        "actor": session.actor_engine.state_dict(),
        "critic": session.critic_engine.state_dict() if session.critic_engine is not None else {},
    }  # full optimizer states, on global rank 0
    trainer_state = {
        **(rank0_to_main(engines) or {}),
        "kl_ctrl": session.kl_ctrl.state_dict(),
        "rng": rng_state(),
        "iteration": iteration,
        "prompt_cursor": session.prompt_cursor,
    }

    def commit() -> str:  # rank 0 writes
        where = ckpt_stage(iteration)
        stage = store.open_stage(ctx.run_id, where, params={"iteration": iteration}, force=True)
        write_policy(stage, "policy", session.lm, session.tokenizer, cfg.model, state_dict=policy)
        if session.critic is not None:
            with saved_model(session.critic.model, state_dict=critic) as files:  # 2 GB at 0.5B: streamed
                for name, path in files.items():
                    stage.write_bytes(f"critic/{name}", path)
        with stage.staged_file("trainer_state.pt") as path:  # GBs of moments: streamed, never one bytes
            save_state(trainer_state, path)
        for m in session.pending:  # updates whose weights this checkpoint makes durable
            stage.write_bytes(f"{PENDING}/{m.stage}.json", m.to_bytes())
        pending = [m.stage for m in session.pending]
        summary = {
            "iteration": iteration,
            "planned_iterations": session.iterations,
            "lineage": session.lineage,
        }
        if session.fork_start is not None:  # a fork resumes from its own checkpoints, its parent's pruned
            summary[FORK_START] = session.fork_start
        uri = stage.commit(summary={**summary, "pending": pending})
        publish_pending(store, store.read_manifest(uri))
        for old in list_checkpoints(store, ctx.run_id)[: -cfg.trainer.max_ckpt_to_keep]:
            store.delete_stage(ctx.run_id, ckpt_stage(old))
        return uri

    uri = on_main(commit)
    session.pending.clear()
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


def resume_iteration(store: ArtifactStore, run_id: str, mode: str) -> int | None:
    """The checkpoint iteration ``trainer.resume_mode`` (``mode``) resumes run ``run_id`` from: the
    last (``auto``), none (``disable``), or the one named (an iteration number, which must exist)."""
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
