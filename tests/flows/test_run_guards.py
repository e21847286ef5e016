"""No silent short runs and no hangs, through the real flows on a tiny model:

- ``verl-flow run`` records planned == completed SFT steps and RL iterations in its result;
- a run killed after an SFT checkpoint and resumed with a loader that runs out fails (exit 1, one
  line naming planned vs completed, MLflow run FAILED) and commits no SFT policy;
- an RL loop whose last iteration trained nothing fails before its final checkpoint;
- a PPO update stuck in a step is failed by the watchdog within ``execution.stall_timeout_s`` (+ a
  poll and the unwinding), naming the stage, the iteration and the last progress.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

import flows.rl as rl_flow
from flows.cli import app
from flows.rl import rl_loop
from stages.floor.locations import list_checkpoints
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from verl_core.config import VerlFlowConfig, with_overrides
from verl_core.runtime.run import RunContext
from verl_core.runtime.run_length import ShortRunError
from verl_core.runtime.tracking import RUN_ID_TAG
from verl_core.runtime.watchdog import StallError
from verl_core.training import sft as sft_loop
from verl_core.training.engine import TrainEngine

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "tests" / "reliability" / "tiny.yaml")  # sft.max_steps=2 (save_every=1), 2 RL iterations
FAST = ["tracking.enabled=true", "export.enable=false", "execution.task_retries=0"]
runner = CliRunner()


def _mlflow_run(store: Path, run_id: str) -> Any:
    client = MlflowClient(tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    exp = client.get_experiment_by_name("verl-flow")
    assert exp is not None
    (found,) = client.search_runs([exp.experiment_id], f"tags.`{RUN_ID_TAG}` = '{run_id}'")
    return found


def test_a_complete_run_records_planned_equal_to_completed(tmp_path: Path) -> None:
    done = runner.invoke(app, ["run", TINY, f"store.url={tmp_path}", *FAST, "--run-id", "full"])
    assert done.exit_code == 0, done.output
    run = _mlflow_run(tmp_path, "full")
    assert run.info.status == "FINISHED"
    result = json.loads(Path(run.info.artifact_uri[len("file://") :], "pipeline_result.json").read_text())
    sft, rl = result["sft_steps"], result["rl_iterations"]
    assert (sft["planned"], sft["completed"], sft["unit"]) == (2, 2, "SFT optimizer steps")
    assert (rl["planned"], rl["completed"], rl["requested"], rl["cap"]) == (2, 2, 2, None)


def test_a_resumed_run_whose_loader_runs_out_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["run", TINY, f"store.url={tmp_path}", *FAST, "--run-id", "short"]
    real_rows = sft_loop.batch_rows

    def killed_at_step_1(n: int, batch_size: int, step: int, *rest: int) -> list[int]:
        if step == 1:  # after the checkpoint of step 1 (sft.save_every=1)
            raise RuntimeError("killed")
        return real_rows(n, batch_size, step, *rest)

    monkeypatch.setattr(sft_loop, "batch_rows", killed_at_step_1)
    killed = runner.invoke(app, args)
    assert killed.exit_code == 1 and "RuntimeError: killed" in killed.stderr, killed.output

    def runs_out_after_step_1(n: int, batch_size: int, step: int, *rest: int) -> Sequence[int]:
        return [] if step >= 1 else real_rows(n, batch_size, step, *rest)

    monkeypatch.setattr(sft_loop, "batch_rows", runs_out_after_step_1)
    resumed = runner.invoke(app, args)  # resumes at step 1 of 2, and the loader has nothing left
    assert resumed.exit_code == 1, resumed.output
    assert "sft: completed 1 of 2 planned SFT optimizer steps, and no stop" in resumed.stderr
    assert "Traceback" not in resumed.output
    assert _mlflow_run(tmp_path, "short").info.status == "FAILED"
    from verl_core.store import ArtifactStore

    assert ArtifactStore(str(tmp_path)).committed("short", "sft") is None  # nothing under-trained shipped


# --- the RL loop alone (no SFT) -------------------------------------------------------------------------

RL = with_overrides(
    VerlFlowConfig.model_validate({"data": {"source": "arithmetic"}}),
    [
        "data.arithmetic_train_size=32",
        "data.arithmetic_val_size=4",
        "data.train_batch_size=2",
        "data.max_response_length=16",
        "data.truncation=right",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_attention_heads=4",
        "model.num_key_value_heads=2",
        "actor.ppo_mini_batch_size=1",
        "critic.ppo_mini_batch_size=1",
        "rollout.n=2",
        "trainer.total_iterations=3",
        "trainer.save_freq=1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.device=cpu",
        "execution.task_retries=0",
        "tracking.enabled=false",
    ],
)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("guards")
    ctx = RunContext(run_id="data", store_url=str(root))
    return root, template_pack.fn(ctx, RL.data, RL.model, preprocess.fn(ctx, RL.data))


def test_an_rl_loop_short_of_its_plan_fails_before_the_final_checkpoint(
    prompts: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tp = prompts
    real_iteration = rl_flow.run_iteration

    def no_batch_for_the_last(loop: Any, session: Any, it: int) -> Any:
        if it < 2:  # the prompt source had nothing for iteration 2: nothing sampled, nothing trained
            return real_iteration(loop, session, it)

    monkeypatch.setattr(rl_flow, "run_iteration", no_batch_for_the_last)
    ctx = RunContext(run_id="rl-short", store_url=str(root))
    with pytest.raises(ShortRunError, match=r"^rl: completed 2 of 3 planned RL iterations, and no stop"):
        rl_loop(ctx, RL, tp, None)
    assert list_checkpoints(ctx.store(), "rl-short") == [1, 2]  # no ckpt/iter-0003 for a 2-update policy


def test_a_stalled_update_is_failed_naming_stage_iteration_and_last_progress(
    prompts: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, tp = prompts
    real_step = TrainEngine.step
    stuck_at: list[float] = []

    def stuck_in_iteration_1(self: TrainEngine, micro_batches: Any, loss_fn: Any, *, where: str = "") -> Any:
        stats = real_step(self, micro_batches, loss_fn, where=where)
        if where == "ppo_update: iteration 1 actor":
            stuck_at.append(time.monotonic())
            time.sleep(120)  # a hang: far past the stall timeout
        return stats

    monkeypatch.setattr(TrainEngine, "step", stuck_in_iteration_1)
    ctx = RunContext(run_id="stalled", store_url=str(root))
    # 10 s: above a cold first rollout in a fresh test process on a loaded 2-core machine (~2-3 s;
    # at load ~6 the 5 s used before fired in an earlier stage)
    cfg = with_overrides(RL, ["execution.stall_timeout_s=10"])
    with pytest.raises(StallError) as err:
        rl_loop(ctx, cfg, tp, None)
    stalled_for = time.monotonic() - stuck_at[0]
    message = str(err.value)
    assert message.startswith("ppo_update (iteration 1): no progress for 10 s (execution.stall_timeout_s)")
    assert "last progress: optimizer_step=" in message and "micro_batch=1/1 at " in message
    # the watchdog ended it, not the 120-s sleep: timeout + a poll (1 s) + Prefect's unwinding (~0.7 s
    # alone, 3.1 s in all on a CI run beside the other xdist worker)
    assert 10 <= stalled_for < 10 + 10, stalled_for
    assert list_checkpoints(ctx.store(), "stalled") == [1]
