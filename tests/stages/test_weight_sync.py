"""The weight-sync contract on content, not counters (issue 14): with ``rollout.share_weights=false``
the HF engine keeps its own copy of the policy, so it samples the trainer's policy only if every
update is synced to it.

- synced: the behaviour log-probs of iteration i's rollout equal the log-probs a plain HF forward
  computes with the trainer's weights at version i (to 1e-5) and differ from those of version i−1;
  the rows record version i;
- the sync removed: iteration 1 is sampled by the version-0 copy, the rows say so, and ``ppo_update``
  refuses the batch with an error naming both versions;
- LoRA (rank 4): the engine's own PEFT copy receives the adapter, same content check.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import stages.floor.session as session_module
import verl_core.training.distributed as distributed_module
from stages.floor.checkpoint import save_checkpoint
from stages.floor.opening import open_session
from stages.floor.session import bound, session_of
from stages.ppo_update import ppo_update
from stages.reward import reward
from stages.rollout import rollout
from tests.stages.conftest import TINY_RL, opened
from verl_core.config import SandboxConfig, VerlFlowConfig
from verl_core.errors import DataError
from verl_core.runtime.run import RunContext

# the engine on its own copy of the policy; GAE (TINY_RL's): the untrained policy scores 0 on every
# sample, so group-relative advantages (GRPO) would be 0 and the update would not move the policy
SYNC_CFG = TINY_RL.model_copy(update={"rollout": TINY_RL.rollout.model_copy(update={"share_weights": False})})
LORA_CFG = SYNC_CFG.model_copy(update={"model": SYNC_CFG.model.model_copy(update={"lora_rank": 4})})


def _ctx(root: Path, tp: str, cfg: VerlFlowConfig, name: str) -> Iterator[RunContext]:
    run = RunContext(run_id=name, store_url=str(root))
    with opened(run, cfg, tp, None):
        yield run


@pytest.fixture
def ctx(tiny_rl: tuple[Path, str], request: pytest.FixtureRequest) -> Iterator[RunContext]:
    yield from _ctx(tiny_rl[0], tiny_rl[1], SYNC_CFG, request.node.name)


@pytest.fixture
def lora_ctx(tiny_rl: tuple[Path, str], request: pytest.FixtureRequest) -> Iterator[RunContext]:
    yield from _ctx(tiny_rl[0], tiny_rl[1], LORA_CFG, request.node.name)


def _rollout(ctx: RunContext, cfg: VerlFlowConfig, tp: str, i: int) -> tuple[str, str]:
    r = rollout.fn(ctx, cfg.data, cfg.rollout, tp, i, session_of(ctx).lineage)
    return r, reward.fn(ctx, cfg.reward, r, i, cfg.data.max_response_length, sandbox=SandboxConfig())


def _snapshot(ctx: RunContext) -> nn.Module:
    """A frozen copy of the trainer's policy as it is now."""
    return copy.deepcopy(session_of(ctx).lm).eval()


def _reference_logprobs(model: nn.Module, prompt: list[int], response: list[int], t: float) -> torch.Tensor:
    """log softmax(logits / T) at each response token, one plain forward (the readable reference)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]  # (P + R, V)
    steps = logits[len(prompt) - 1 : len(prompt) + len(response) - 1] / t  # (R, V): predicts response[k]
    return torch.log_softmax(steps.float(), dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _max_gap(ctx: RunContext, rollout_uri: str, model: nn.Module, t: float) -> float:
    """max |behaviour log-prob − reference log-prob under ``model``| over the rollout's tokens."""
    store = ctx.store()
    rows = store.read_table(store.read_manifest(rollout_uri), "rollouts.parquet").to_pylist()
    gap = 0.0
    for row in rows:
        ref = _reference_logprobs(model, row["prompt_ids"], row["response_ids"], t)
        gap = max(gap, (torch.tensor(row["logprobs"]) - ref).abs().max().item())
    return gap


def _versions(ctx: RunContext, rollout_uri: str) -> set[int]:
    store = ctx.store()
    table = store.read_table(store.read_manifest(rollout_uri), "rollouts.parquet")
    return set(table.column("policy_version").to_pylist())


def _check_synced_loop(ctx: RunContext, cfg: VerlFlowConfig, tp: str, updates: int) -> None:
    t = cfg.rollout.temperature
    snapshots = [_snapshot(ctx)]  # version 0
    for i in range(updates + 1):
        r, w = _rollout(ctx, cfg, tp, i)
        assert _versions(ctx, r) == {i}  # the version the engine held
        assert _max_gap(ctx, r, snapshots[i], t) < 1e-5  # sampled by policy version i
        if i > 0:  # and not by the previous one: the engine did move
            assert _max_gap(ctx, r, snapshots[i - 1], t) > 1e-4
        if i < updates:
            ppo_update.fn(ctx, cfg, r, w, i)
            assert session_of(ctx).engine.policy_version == i + 1
            snapshots.append(_snapshot(ctx))


def test_own_copy_engine_samples_the_trainer_policy_of_each_version(
    ctx: RunContext, tiny_rl: tuple[Path, str]
) -> None:
    engine = session_of(ctx).engine
    assert not engine.shares_weights and engine.model is not session_of(ctx).lm  # type: ignore[attr-defined]
    _check_synced_loop(ctx, SYNC_CFG, tiny_rl[1], updates=2)


def test_without_the_sync_the_version_guard_fails_the_update(
    ctx: RunContext, tiny_rl: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_module, "sync_rollout_weights", lambda session: 0.0)  # advance_policy's sync
    r0, w0 = _rollout(ctx, SYNC_CFG, tiny_rl[1], 0)
    before = _snapshot(ctx)
    ppo_update.fn(ctx, SYNC_CFG, r0, w0, 0)  # trainer at version 1, the engine still at 0
    r1, w1 = _rollout(ctx, SYNC_CFG, tiny_rl[1], 1)
    assert _versions(ctx, r1) == {0}
    assert _max_gap(ctx, r1, before, SYNC_CFG.rollout.temperature) < 1e-5  # indeed the stale policy
    with pytest.raises(DataError, match=r"iteration 1: .* policy version 0, but the trainer is at version 1"):
        ppo_update.fn(ctx, SYNC_CFG, r1, w1, 1)
    assert session_of(ctx).version == 1  # refused before any weight changed


def test_rollout_ahead_allows_a_lagging_batch(ctx: RunContext, tiny_rl: tuple[Path, str]) -> None:
    # the guard by hand: trainer at 1, rows at 0 → lag 1; allowed with rollout_ahead 1, not with 0
    from stages.floor.artifacts import check_policy_lag

    store = ctx.store()
    r0, _ = _rollout(ctx, SYNC_CFG, tiny_rl[1], 0)
    rows = store.read_table(store.read_manifest(r0), "rollouts.parquet")
    check_policy_lag(rows, 1, 1, 1, r0)
    with pytest.raises(DataError, match="policy version 0, but the trainer is at version 1"):
        check_policy_lag(rows, 1, 0, 1, r0)
    with pytest.raises(DataError, match="policy version 0, but the trainer is at version -1"):
        check_policy_lag(rows, -1, 0, 1, r0)  # a rollout newer than the trainer is refused too


def test_resumed_state_gives_its_engine_the_checkpointed_policy(
    ctx: RunContext, tiny_rl: tuple[Path, str]
) -> None:
    r0, w0 = _rollout(ctx, SYNC_CFG, tiny_rl[1], 0)
    ppo_update.fn(ctx, SYNC_CFG, r0, w0, 0)
    save_checkpoint(session_of(ctx), ctx, SYNC_CFG, 1)
    state = open_session(ctx, SYNC_CFG, tiny_rl[1], None)  # resumed (trainer.resume_mode auto)
    with bound(state):
        assert state.version == 1 and state.engine.policy_version == 1
        own = state.engine.model.state_dict()  # type: ignore[attr-defined]
        assert all(torch.equal(own[k], v) for k, v in state.lm.state_dict().items())
    state.close()


def test_lora_engine_receives_the_adapter_of_each_version(
    lora_ctx: RunContext, tiny_rl: tuple[Path, str]
) -> None:
    state = session_of(lora_ctx)
    assert hasattr(state.lm, "peft_config") and hasattr(state.engine.model, "peft_config")  # type: ignore[attr-defined]
    _check_synced_loop(lora_ctx, LORA_CFG, tiny_rl[1], updates=1)


def test_sync_from_an_fsdp2_sharded_policy_gives_the_engine_owner_the_full_weights(tmp_path: Path) -> None:
    # 2 gloo ranks: the policy fully_shard-ed per decoder layer; rank 0's own-copy engine receives
    # the gathered weights (bit-equal to the unsharded model's, on the CPU) and samples its greedy
    # tokens; rank 1 (owning no engine) takes part in the gather and keeps nothing
    import json
    import os
    import subprocess
    import sys

    from tests.stages import weight_sync_worker

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, weight_sync_worker.__file__, str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=env, cwd=repo,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    owner = json.loads((tmp_path / "rank0.json").read_text())
    want = {"keys_equal": True, "max_diff": 0.0, "tokens_equal": True, "version": 1, "devices": ["cpu"]}
    assert owner == want
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"kept": 0}  # an engine-less rank keeps none


class _MeshShard(torch.Tensor):
    """Stands for an FSDP2 ``DTensor`` shard living on ``on`` of a mesh on ``mesh``: ``full_tensor``
    (the all-gather) refuses a shard that is not on the mesh's device, as NCCL refuses CPU tensors;
    every ``to`` and gather is recorded in ``log``."""

    on: str
    mesh: str
    log: list[tuple[str, str]]

    @staticmethod
    def __new__(cls, data: torch.Tensor, on: str, mesh: str, log: list[tuple[str, str]]) -> _MeshShard:
        shard = torch.Tensor._make_subclass(cls, data)
        shard.on, shard.mesh, shard.log = on, mesh, log
        return shard

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device(self.on)

    @property
    def device_mesh(self) -> object:
        import types

        return types.SimpleNamespace(device_type=self.mesh)

    def to(self, device: object, *args: object, **kwargs: object) -> _MeshShard:  # type: ignore[override]
        self.log.append(("to", str(device)))
        return _MeshShard(self.as_subclass(torch.Tensor), str(device), self.mesh, self.log)

    def full_tensor(self) -> torch.Tensor:
        self.log.append(("full_tensor", self.on))
        if self.on != self.mesh:
            raise RuntimeError(f"all-gather of a {self.on} tensor on a {self.mesh} process group")
        return self.as_subclass(torch.Tensor).clone()


def test_an_offloaded_shard_is_gathered_on_its_mesh_s_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # fsdp2 with param_offload keeps the shards on the CPU while the mesh (NCCL) is on CUDA: the gather
    # moves each shard to the mesh's device first (torch's own full state dict does the same), then the
    # full tensor comes back to the CPU for the engine
    import torch.distributed.checkpoint.state_dict as dcp_state_dict
    import torch.distributed.tensor as dtensor

    log: list[tuple[str, str]] = []
    shard = _MeshShard(torch.arange(4.0), "cpu", "cuda", log)
    monkeypatch.setattr(dtensor, "DTensor", _MeshShard)
    monkeypatch.setattr(dcp_state_dict, "get_model_state_dict", lambda lm, options: {"w": shard})
    monkeypatch.setattr(distributed_module, "distributed", lambda: True)
    weights = distributed_module.policy_weights(nn.Linear(1, 1))
    assert log == [("to", "cuda"), ("full_tensor", "cuda")]
    assert type(weights["w"]) is torch.Tensor and weights["w"].device.type == "cpu"
    assert torch.equal(weights["w"], torch.arange(4.0))
