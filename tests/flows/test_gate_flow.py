"""The gate in the pipeline and the CI verdict: a tiny quickstart run whose first model misses the
floor (gate.min_accuracy=1.0) with gate.require_promotion ends failed with the decision's one line and
the registry untouched; ``verl-flow run --require-promotion`` exits 3 with the decision's line when
the gate rejected, and refuses to start without gate.enable."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from flows.results import GateOutcome, PipelineResult
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
SMALL = [
    "data.arithmetic_train_size=64",
    "data.arithmetic_val_size=8",
    "sft.enable=false",
    "trainer.total_iterations=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=2",
    "critic.ppo_mini_batch_size=2",
    "eval.k=1",
]


def test_a_rejected_first_model_fails_the_run_with_the_decision(tmp_path: Path) -> None:
    # a tiny scratch model after 1 RL iteration answers (almost) none of 8 prompts: accuracy < 1.0
    gate = ["gate.enable=true", "gate.min_accuracy=1.0", "gate.require_promotion=true"]
    args = ["run", QUICKSTART, f"store.url={tmp_path}", *SMALL, *gate, "--run-id", "night"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 3, result.output
    line = result.output.strip().splitlines()[-1]  # (MLflow's own INFO lines come before it)
    assert line.startswith("error: gate: reject: first model: accuracy ")
    assert line.endswith("< gate.min_accuracy 1.0")
    (log,) = (tmp_path / "logs").rglob("*.log")
    # the flow run fails on the decision (what `prefect deployment run --watch` reports)
    assert "Encountered exception during execution: PromotionRefused('gate: reject" in log.read_text()

    store = ArtifactStore(str(tmp_path))
    gate_stage = store.committed("night", "gate")
    assert gate_stage is not None and gate_stage.summary["verdict"] == "reject"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (model,) = client.search_registered_models()
    assert not model.aliases  # nothing promoted
    (version,) = client.search_model_versions(f"name = '{model.name}'")
    assert version.tags["verl_flow.decision.verdict"] == "reject"
    # the run itself finished and was recorded before the verdict failed the flow run
    (run,) = client.search_runs([client.get_experiment_by_name("verl-flow").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["verl_flow.gate.verdict"] == "reject"


def test_require_promotion_flag_exits_3_with_the_decision_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flows.pipeline

    line = "gate: reject: accuracy 0.500 → 0.400, difference -0.100 [-0.300, +0.100], p=0.5 (b=3, c=1)"
    rejected = PipelineResult(run_id="x", gate=GateOutcome(verdict="reject", line=line))
    monkeypatch.setattr(flows.pipeline, "rlhf_pipeline", lambda **_: rejected)
    runner = CliRunner()
    base = ["run", QUICKSTART, f"store.url={tmp_path}", "gate.enable=true"]
    result = runner.invoke(app, [*base, "--require-promotion"])
    assert result.exit_code == 3 and result.output.strip().splitlines()[-1] == f"error: {line}"
    # without the flag the run completes and names the decision
    result = runner.invoke(app, base)
    assert result.exit_code == 0 and line in result.output
    # the flag without a gate: refused before any work
    result = runner.invoke(app, ["run", QUICKSTART, f"store.url={tmp_path}", "--require-promotion"])
    assert result.exit_code == 2 and "gate.enable is false" in result.output
