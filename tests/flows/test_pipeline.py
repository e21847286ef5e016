"""End to end: `verl-flow run` on the quickstart config through the real CLI and Prefect (no server),
then a rerun with the same run id that skips every committed stage."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient
from typer.testing import CliRunner

from flows.cli import app
from verl_core.runtime.tracking import RUN_ID_TAG
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def test_quickstart_pipeline_runs_and_rerun_skips(tmp_path: Path) -> None:
    runner = CliRunner()
    small = [
        "data.arithmetic_train_size=200",
        "data.arithmetic_val_size=20",
        "sft.max_steps=6",
        "sft.save_every=3",
        "trainer.total_iterations=2",
        "trainer.test_freq=1",
        "trainer.save_freq=1",
        "data.train_batch_size=8",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "eval.k=4",
    ]
    args = ["run", QUICKSTART, f"store.url={tmp_path}", *small, "--run-id", "e2e"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output

    store = ArtifactStore(str(tmp_path))
    record = store.read_run_record("e2e")
    assert record.config["store"]["url"] == str(tmp_path)
    assert len(record.config_hash) == 64
    manifests = {m.stage: m for m in store.list_manifests("e2e")}
    for stage in manifests.values():
        for entry in stage.files:
            if entry.kind:
                store.read_table(stage, entry.name)  # sha256 and schema checked on read

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("verl-flow").experiment_id], f"tags.`{RUN_ID_TAG}` = 'e2e'"
    )
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["trainer.experiment_name"] == "quickstart"
    result = json.loads(Path(runs[0].info.artifact_uri[len("file://") :], "pipeline_result.json").read_text())
    ran = {stage for stage, uri in result["stages"].items() if uri}
    assert ran == {"preprocess", "template_pack", "sft", "rl", "export", "eval", "report"}
    assert set(result["timing_s"]) == ran - {"report"}  # wall seconds per stage
    assert set(result["rl_timing_s"]) == {"rollout", "reward", "update", "validate"}  # inside the loop
    assert manifests["sft"].summary["steps"] == 6
    # every RL stage of both iterations is committed, with validation before, between and after
    for it in (0, 1):
        for name in ("rollout", "reward", "update"):
            assert f"iter-{it:04d}/{name}" in manifests
    assert {f"iter-{i:04d}/val" for i in (0, 1, 2)} <= set(manifests)
    assert {"ckpt/iter-0001", "ckpt/iter-0002"} <= set(manifests)
    assert result["stages"]["rl"].endswith("ckpt/iter-0002/manifest.json")
    assert set(result["val_accuracy"]) == {"0", "1", "2"}
    # export of the last checkpoint, registered; eval of that export; plots in the report
    assert result["stages"]["export"].endswith("export/iter-0002/manifest.json")
    assert manifests["export/iter-0002"].summary["registered_model"]["name"] == "verl-flow-quickstart"
    assert manifests["eval/export-iter-0002"].summary["prompts"] == 20
    assert result["eval"]["source"] == "export-iter-0002" and result["eval"]["k"] == 4
    assert 0.0 <= result["eval"]["accuracy"] <= 1.0 and result["eval"]["pass_at_k"] is not None
    plots = {f.name for f in manifests["report"].files if f.name.endswith(".png")}
    assert {
        f"plots/{n}.png" for n in ("reward_accuracy", "kl", "entropy", "response_length", "timing")
    } == plots
    logged = {a.path for a in client.list_artifacts(runs[0].info.run_id, "plots")}
    assert "plots/kl.png" in logged
    rollouts = store.read_table(manifests["iter-0001/rollout"], "rollouts.parquet")
    assert rollouts.num_rows == 8 * 4  # train_batch_size × rollout.n
    assert set(rollouts.column("policy_version").to_pylist()) == {1}

    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    assert "held-out accuracy" in second.stdout  # the summary is rebuilt from committed validations
    assert "RL phase" in second.stdout  # rl_timing_s, printed as a table of its own
    again = {m.stage: m for m in store.list_manifests("e2e")}
    # nothing ran twice: every committed stage kept its attempt (the report is redrawn every time)
    kept = {k: m.attempt for k, m in again.items() if k != "report"}
    assert kept == {k: m.attempt for k, m in manifests.items() if k != "report"}

    # the CLI on the finished run: export an earlier checkpoint to a directory, evaluate it, show plots
    exported = runner.invoke(
        app, ["export", "e2e", "--iteration", "1", "--to", str(tmp_path / "m1"), "--store", str(tmp_path)]
    )
    assert exported.exit_code == 0, exported.output
    assert (tmp_path / "m1" / "model.safetensors").is_file() and "version 2" in exported.stdout
    evaluated = runner.invoke(
        app,
        [
            "eval",
            "e2e",
            "eval.k=1",
            "eval.max_samples=5",
            "--model",
            str(tmp_path / "m1"),
            "--store",
            str(tmp_path),
        ],
    )
    assert evaluated.exit_code == 0, evaluated.output
    assert "accuracy (greedy)" in evaluated.stdout and "synthetic/arithmetic" in evaluated.stdout
    shown = runner.invoke(app, ["runs", "show", "e2e", "--store", str(tmp_path)])
    assert "reward_accuracy.png" in shown.stdout and "mlflow" in shown.stdout.lower()


def test_fork_deployment_takes_config_parent_beside_config_file() -> None:
    # the `fork` deployment: config_file + the typed config.parent; outside a deployment whose config
    # parameter says what a Run form showed (tests/flows/test_deployments_day_two.py), any other
    # config field is refused
    from flows.pipeline import _base_config
    from verl_core.config import ParentConfig, VerlFlowConfig
    from verl_core.errors import ConfigError

    parent = ParentConfig(run_id="a", iteration=3)
    cfg, edits = _base_config(VerlFlowConfig(parent=parent), "configs/quickstart.yaml")
    assert cfg.parent == parent and cfg.trainer.experiment_name == "quickstart" and edits is None
    try:
        _base_config(VerlFlowConfig(parent=parent, sandbox={"timeout_s": 9.0}), "configs/quickstart.yaml")
    except ConfigError as e:
        assert str(e).startswith("config_file: give either config_file or config fields")
    else:
        raise AssertionError("a config field beside config_file was accepted")
