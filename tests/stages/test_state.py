"""The RL session's opening and checkpoint protocol (stages/floor/opening.py, checkpoint.py) on a
tiny model: a checkpoint publishes the update manifests it makes durable, a resume restores the policy
version, the optimizer and the weights, checkpoints of another policy lineage or missing iterations
are refused with the field to change, and only the last ``trainer.max_ckpt_to_keep`` are kept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from stages.floor.checkpoint import save_checkpoint
from stages.floor.locations import ckpt_stage, iteration_stage, list_checkpoints
from stages.floor.opening import open_session
from stages.floor.session import RLSession, advance_policy, seal_update, set_prompt_cursor
from stages.floor.specs import planned_iterations
from tests.stages.conftest import TINY_RL, opened
from verl_core.config import with_overrides
from verl_core.errors import ConfigError
from verl_core.runtime.run import RunContext


@pytest.fixture
def ctx(tiny_rl: tuple[Path, str], request: pytest.FixtureRequest) -> Iterator[RunContext]:
    yield RunContext(run_id=request.node.name.replace("[", "-").rstrip("]"), store_url=str(tiny_rl[0]))


def _train_one_step(session: RLSession) -> None:
    """One actor optimizer step on a toy loss (sum of squares), as an update would take."""
    engine = session.actor_engine
    engine.step([0], lambda _: sum((p.float() ** 2).sum() for p in engine.params) * 1e-3)


def test_fresh_state_plans_its_lr_schedule_over_the_planned_iterations(
    ctx: RunContext, tiny_rl: tuple[Path, str]
) -> None:
    cfg = with_overrides(TINY_RL, ["trainer.total_epochs=1"])
    with opened(ctx, cfg, tiny_rl[1], None) as state:
        assert state.version == 0 and state.critic is not None
    n = int(ctx.store().read_manifest(tiny_rl[1]).summary["rows"]["prompts_train"])
    # 1 epoch of n prompts at 2 per iteration caps the 4 iterations only when n < 8
    assert planned_iterations(cfg, n) == min(4, -(-n // 2))
    # actor: iterations × ppo_epochs (1) × mini-batches per iteration (2 // 1)
    assert state.actor_engine.spec.total_steps == planned_iterations(cfg, n) * 1 * 2
    assert state.iterations == planned_iterations(cfg, n)  # the loop's length too


def test_checkpoint_publishes_pending_updates_and_resume_restores_the_optimizer(
    ctx: RunContext, tiny_rl: tuple[Path, str]
) -> None:
    store = ctx.store()
    state = open_session(ctx, TINY_RL, tiny_rl[1], None)
    _train_one_step(state)
    advance_policy(state, 0)  # the policy after update 0: version 1
    set_prompt_cursor(state, 6)  # e.g. three generation batches of 2 prompts (dynamic sampling)
    # an update stage sealed, not published: it becomes visible only with the checkpoint
    update = store.open_stage(ctx.run_id, iteration_stage(0, "update"))
    update.write_json("report.json", {"iteration": 0})
    seal_update(state, update.seal({"iteration": 0}))
    assert store.committed(ctx.run_id, iteration_stage(0, "update")) is None

    uri = save_checkpoint(state, ctx, TINY_RL, 1)
    ckpt = store.read_manifest(uri)
    assert ckpt.stage == ckpt_stage(1)
    assert ckpt.summary["pending"] == ["iter-0000/update"] and state.pending == []
    assert store.committed(ctx.run_id, iteration_stage(0, "update")) is not None
    weights = {k: v.clone() for k, v in state.lm.state_dict().items()}
    optimizer = state.actor_engine.optimizer.state_dict()

    state.close()
    resumed = open_session(ctx, TINY_RL, tiny_rl[1], None)  # resume_mode=auto: the last checkpoint
    assert resumed.version == 1 and resumed.prompt_cursor == 6
    assert resumed.actor_engine.global_step == 1
    assert resumed.actor_engine.scheduler.last_epoch == 1
    moments = resumed.actor_engine.optimizer.state_dict()["state"]
    assert moments.keys() == optimizer["state"].keys()
    for k, s in optimizer["state"].items():
        assert torch.equal(moments[k]["exp_avg"], s["exp_avg"])
    for k, v in resumed.lm.state_dict().items():
        assert torch.equal(v, weights[k]), k
    resumed.close()


def test_checkpoint_of_another_lineage_is_refused(ctx: RunContext, tiny_rl: tuple[Path, str]) -> None:
    with opened(ctx, TINY_RL, tiny_rl[1], None) as session:
        save_checkpoint(session, ctx, TINY_RL, 0)
    other = with_overrides(TINY_RL, ["actor.lr=5e-4"])  # changes what the policy becomes
    with pytest.raises(
        ConfigError, match=r"^trainer.resume_mode: checkpoint ckpt/iter-0000 .* other settings"
    ):
        open_session(ctx, other, tiny_rl[1], None)
    # resume_mode=disable restarts RL from the initial policy instead
    with opened(ctx, with_overrides(other, ["trainer.resume_mode=disable"]), tiny_rl[1], None) as session:
        assert session.version == 0


def test_resume_from_a_missing_iteration_lists_the_checkpoints(
    ctx: RunContext, tiny_rl: tuple[Path, str]
) -> None:
    with pytest.raises(ConfigError, match=r"no checkpoint at iteration 2 .* \(available: none\)"):
        open_session(ctx, with_overrides(TINY_RL, ["trainer.resume_mode=2"]), tiny_rl[1], None)
    with opened(ctx, TINY_RL, tiny_rl[1], None) as session:
        save_checkpoint(session, ctx, TINY_RL, 0)
        save_checkpoint(session, ctx, TINY_RL, 1)
    with pytest.raises(
        ConfigError,
        match=r"^trainer.resume_mode: no checkpoint at iteration 2 in run .* \(available: 0, 1\)$",
    ):
        open_session(ctx, with_overrides(TINY_RL, ["trainer.resume_mode=2"]), tiny_rl[1], None)
    with opened(ctx, with_overrides(TINY_RL, ["trainer.resume_mode=0"]), tiny_rl[1], None) as session:
        assert session.version == 0


def test_only_the_last_checkpoints_are_kept(ctx: RunContext, tiny_rl: tuple[Path, str]) -> None:
    cfg = with_overrides(TINY_RL, ["trainer.max_ckpt_to_keep=2"])
    with opened(ctx, cfg, tiny_rl[1], None) as session:
        for it in (1, 2, 3):
            save_checkpoint(session, ctx, cfg, it)
    assert list_checkpoints(ctx.store(), ctx.run_id) == [2, 3]


# --- ref.path: a reference other than the starting policy ---------------------------------------------


def _saved_policy(tiny_rl: tuple[Path, str], directory: Path, *, seed: int, extra_vocab: int = 0) -> str:
    """A tiny policy of another seed saved as an HF dir; ``extra_vocab`` rows more than the tokenizer."""
    from stages.floor.artifacts import load_tokenizer
    from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config

    tokenizer = load_tokenizer(RunContext(run_id="data", store_url=str(tiny_rl[0])).store(), tiny_rl[1])
    m = TINY_RL.model
    spec = ScratchSpec("qwen2", m.hidden_size, m.num_hidden_layers, m.num_attention_heads,
                       m.num_key_value_heads, m.intermediate_size, m.max_position_embeddings)  # fmt: skip
    config = scratch_config(
        spec,
        len(tokenizer) + extra_vocab,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    init_causal_lm(config, seed=seed).save_pretrained(directory)
    return str(directory)


def test_ref_path_loads_that_reference(ctx: RunContext, tiny_rl: tuple[Path, str], tmp_path: Path) -> None:
    from verl_core.models.loading import load_causal_lm
    from verl_core.models.packed import PackedCausalLM
    from verl_core.training.ppo_kernels import make_ppo_batch, response_log_probs

    path = _saved_policy(tiny_rl, tmp_path / "ref", seed=123)
    cfg = with_overrides(TINY_RL, [f"ref.path={path}", "actor.use_kl_loss=true"])
    state = open_session(ctx, cfg, tiny_rl[1], None)
    assert state.ref is not None
    batch = make_ppo_batch([[5, 6, 7]], [[8, 9]])
    with torch.no_grad():
        got = response_log_probs(state.ref, batch)[0]
        want = response_log_probs(PackedCausalLM(load_causal_lm(path)), batch)[0]
        policy = response_log_probs(state.actor, batch)[0]
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, policy)  # not the starting policy
    state.close()


def test_ref_path_with_lora_loads_that_reference_not_the_base(
    ctx: RunContext, tiny_rl: tuple[Path, str], tmp_path: Path
) -> None:
    # without ref.path a LoRA policy's reference is its own base with the adapters disabled; with
    # ref.path it is that model (issue 13, bug 3: "also with LoRA")
    from verl_core.models.loading import load_causal_lm
    from verl_core.models.packed import PackedCausalLM
    from verl_core.training.ppo_kernels import make_ppo_batch, response_log_probs

    path = _saved_policy(tiny_rl, tmp_path / "ref", seed=123)
    cfg = with_overrides(TINY_RL, [f"ref.path={path}", "actor.use_kl_loss=true", "model.lora_rank=4"])
    state = open_session(ctx, cfg, tiny_rl[1], None)
    assert isinstance(state.ref, PackedCausalLM)  # not AdapterDisabledPolicy(actor)
    batch = make_ppo_batch([[5, 6, 7]], [[8, 9]])
    with torch.no_grad():
        got = response_log_probs(state.ref, batch)[0]
        want = response_log_probs(PackedCausalLM(load_causal_lm(path)), batch)[0]
    torch.testing.assert_close(got, want)
    state.close()


def test_ref_path_with_another_vocabulary_is_refused(
    ctx: RunContext, tiny_rl: tuple[Path, str], tmp_path: Path
) -> None:
    path = _saved_policy(tiny_rl, tmp_path / "ref", seed=123, extra_vocab=7)
    cfg = with_overrides(TINY_RL, [f"ref.path={path}", "algorithm.use_kl_in_reward=true"])
    with pytest.raises(ConfigError, match=r"ref.path: .* has a vocabulary of \d+ tokens, the policy \d+"):
        open_session(ctx, cfg, tiny_rl[1], None)


def test_release_cached_memory_returns_freed_heap_to_the_os() -> None:
    import psutil

    from stages.floor.session import release_cached_memory

    proc = psutil.Process()
    # freeing a 16 MiB tensor (mmapped) raises glibc's mmap threshold to 16 MiB: the 4 MiB tensors
    # after it come from the heap, and freeing them leaves the pages resident
    del_me = torch.ones(4 * 2**20)
    del del_me
    blocks = [torch.ones(2**20) for _ in range(128)]  # 128 × 4 MiB = 512 MiB
    held = proc.memory_info().rss
    del blocks
    release_cached_memory()
    # the 512 MiB go back (allow 128 MiB of other allocations in between)
    assert proc.memory_info().rss < held - 384 * 2**20
