"""End to end on vLLM: `verl-flow run ... rollout.name=vllm` through the real CLI and Prefect (local
mode), with vLLM in its own environment (:class:`~verl_core.rollout.vllm_process.VLLMProcessEngine`,
a subprocess of ``.venv-vllm``). Two engine starts (~35 s each on 2 cores, eager): the RL loop's one
engine for every rollout and validation, then the eval's; each closed when its stage ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tests.vllm_env import vllm_python
from verl_core.rollout import vllm_process
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")  # hidden 128, 4 heads: head size 32 (vLLM CPU)
ITERATIONS = 3
TOL = 1e-5  # fp32 on both sides: summation order only (tests/vllm/checks.py)


class EngineSpy:
    """Every VLLMProcessEngine the run builds: its subprocess, generate calls, and the order of
    starts and closes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engines: list[Any] = []
        self.events: list[tuple[str, int]] = []  # ("start" | "close", engine number)
        self.generates: dict[int, int] = {}
        cls = vllm_process.VLLMProcessEngine
        init, generate, close = cls.__init__, cls.generate, cls.close
        spy = self

        def spied_init(engine: Any, *args: Any, **kwargs: Any) -> None:
            init(engine, *args, **kwargs)
            spy.engines.append(engine)
            spy.generates[len(spy.engines) - 1] = 0
            spy.events.append(("start", len(spy.engines) - 1))

        def spied_generate(engine: Any, *args: Any, **kwargs: Any) -> Any:
            spy.generates[spy.number(engine)] += 1
            return generate(engine, *args, **kwargs)

        def spied_close(engine: Any) -> None:
            if engine in spy.engines and engine._proc.poll() is None:
                spy.events.append(("close", spy.number(engine)))
            close(engine)

        monkeypatch.setattr(cls, "__init__", spied_init)
        monkeypatch.setattr(cls, "generate", spied_generate)
        monkeypatch.setattr(cls, "close", spied_close)

    def number(self, engine: Any) -> int:
        return next(i for i, e in enumerate(self.engines) if e is engine)


def test_pipeline_on_vllm_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python = vllm_python()  # fail / skip before any work when the vLLM environment is missing
    spy = EngineSpy(monkeypatch)
    small = [
        "data.arithmetic_train_size=100",
        "data.arithmetic_val_size=8",
        "sft.enable=false",  # RL from the initial model: the engines are what is tested
        f"trainer.total_iterations={ITERATIONS}",
        "trainer.test_freq=2",  # validations at 0 (before RL), 2 and 3 (the end)
        "trainer.save_freq=0",
        "data.train_batch_size=8",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "eval.k=2",
        "rollout.name=vllm",
        f"rollout.vllm_python={python}",
        "rollout.vllm_enforce_eager=true",  # engine start ~35 s instead of ~55 s
        "rollout.cpu_kv_cache_gib=0.25",
    ]
    args = ["run", QUICKSTART, f"store.url={tmp_path}", *small, "--run-id", "vllm-e2e"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output

    # two vLLM engines: the RL loop's (closed when the loop ended, before the eval's started) and
    # the eval's; no subprocess left running
    assert spy.events == [("start", 0), ("close", 0), ("start", 1), ("close", 1)]
    assert all(e._proc.poll() is not None for e in spy.engines)
    # the loop's engine answered every rollout and validation: 3 rollouts, 3 validations × (greedy +
    # the eval.k sampled pass); the eval's, its greedy and sampled passes
    assert spy.generates == {0: ITERATIONS + 3 * 2, 1: 2}

    store = ArtifactStore(str(tmp_path))
    manifests = {m.stage: m for m in store.list_manifests("vllm-e2e")}
    for it in range(ITERATIONS):
        rollouts = store.read_table(manifests[f"iter-{it:04d}/rollout"], "rollouts.parquet")
        assert rollouts.num_rows == 8 * 4
        # the engine held policy `it`: the weights of update it-1 were synced into the subprocess
        assert set(rollouts.column("policy_version").to_pylist()) == {it}
        update = manifests[f"iter-{it:04d}/update"].summary
        assert update["policy_version"] == it + 1
        # vLLM's behaviour log-probs = the trainer's recomputed old log-probs (same weights)
        assert update["rollout_corr/log_prob_abs_diff_max"] < TOL, update
    for done in (0, 2, ITERATIONS):
        val = store.read_table(manifests[f"iter-{done:04d}/val"], "rollouts.parquet")
        assert set(val.column("policy_version").to_pylist()) == {done}
    report = manifests[f"eval/export-iter-{ITERATIONS:04d}"].summary
    assert report["prompts"] == 8 and report["k"] == 2 and 0.0 <= report["accuracy"] <= 1.0
