"""The verl-flow CLI: config show, one-line config errors with exit 2, runs list/show."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import yaml
from typer.testing import CliRunner

from flows.cli import app
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
runner = CliRunner()


def test_config_show_prints_resolved_yaml_with_overrides() -> None:
    result = runner.invoke(app, ["config", "show", QUICKSTART, "trainer.total_iterations=3", "rollout.n=8"])
    assert result.exit_code == 0, result.output
    body, _, hash_line = result.stdout.rpartition("# config_hash: ")
    resolved = yaml.safe_load(body)
    assert resolved["trainer"]["total_iterations"] == 3
    assert resolved["rollout"]["n"] == 8
    assert resolved["actor"]["lr"] == 6e-5  # from the YAML file
    assert len(hash_line.strip()) == 64


def test_bad_value_exits_2_with_one_line() -> None:
    result = runner.invoke(app, ["config", "show", QUICKSTART, "actor.lr=abc"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: actor.lr: got 'abc', expected a number"]
    assert "Traceback" not in result.output


def test_unknown_key_exits_2_with_suggestion() -> None:
    result = runner.invoke(app, ["config", "show", QUICKSTART, "actr.lr=1"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: unknown key 'actr' (did you mean 'actor'?)"


def test_run_validates_config_before_any_work(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", QUICKSTART, f"store.url={tmp_path}", "rollout.name=vlm"])
    assert result.exit_code == 2
    assert "rollout.name: got 'vlm', expected one of 'hf', 'vllm' or 'auto'" in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_run_lists_every_preflight_problem_before_any_work(tmp_path: Path) -> None:
    # quickstart: 32 prompts, mini-batches of 8; defaults 128 + 64 tokens per sample
    args = ["actor.ppo_mini_batch_size=5", "actor.ppo_max_token_len_per_gpu=100"]
    result = runner.invoke(app, ["run", QUICKSTART, f"store.url={tmp_path}", *args])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: actor.ppo_mini_batch_size: 5 must divide data.train_batch_size (32)",
        "error: actor.ppo_max_token_len_per_gpu: 100 tokens cannot hold one full-length sample "
        "(data.max_prompt_length + data.max_response_length = 192); expected >= 192",
    ]
    assert list(tmp_path.iterdir()) == []


def test_runs_list_and_show(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    store.write_run_record("run-x", {"trainer": {"experiment_name": "exp"}}, "ab" * 32)
    stage = store.open_stage("run-x", "preprocess")
    stage.write_table(
        "metrics.parquet", pa.table({"step": [1, 2], "name": ["a", "b"], "value": [0.5, 1.0]}), kind="metrics"
    )
    stage.write_json("report.json", {"kept": 2})
    stage.commit()

    listed = runner.invoke(app, ["runs", "list", "--store", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert "run-x" in listed.stdout and "exp" in listed.stdout and "abababababab" in listed.stdout

    shown = runner.invoke(app, ["runs", "show", "run-x", "--store", str(tmp_path)])
    assert shown.exit_code == 0, shown.output
    row = next(line for line in shown.stdout.splitlines() if "metrics.parquet" in line)
    assert "preprocess" in row and "metrics" in row and " 2 " in row

    missing = runner.invoke(app, ["runs", "show", "nope", "--store", str(tmp_path)])
    assert missing.exit_code == 1
    assert "run.json does not exist" in missing.stderr


def test_help_on_each_command() -> None:
    for args in (["--help"], ["run", "--help"], ["config", "show", "--help"], ["runs", "list", "--help"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "Usage" in result.stdout


def test_runs_list_and_show_piped_keep_whole_values_and_json(tmp_path: Path) -> None:
    # CliRunner's stdout is not a terminal, as in `verl-flow runs list > file` or a CI log
    run_id = "a-run-id-long-enough-to-be-cut-at-eighty-columns-by-a-fitted-table-0123456789"
    experiment = "an-experiment-name-just-as-long-as-the-run-id-to-push-the-table-past-80-columns"
    store = ArtifactStore(str(tmp_path))
    store.write_run_record(run_id, {"trainer": {"experiment_name": experiment}}, "cd" * 32)
    stage = store.open_stage(run_id, "preprocess")
    stage.write_json("a/report-with-a-long-artifact-name-that-a-fitted-table-would-ellipsize.json", {"x": 1})
    stage.commit()

    listed = runner.invoke(app, ["runs", "list", "--store", str(tmp_path)], env={"COLUMNS": "80"})
    assert listed.exit_code == 0, listed.output
    assert run_id in listed.stdout and experiment in listed.stdout and "…" not in listed.stdout
    shown = runner.invoke(app, ["runs", "show", run_id, "--store", str(tmp_path)], env={"COLUMNS": "80"})
    assert shown.exit_code == 0, shown.output
    assert "a/report-with-a-long-artifact-name-that-a-fitted-table-would-ellipsize.json" in shown.stdout
    assert run_id in shown.stdout and "…" not in shown.stdout

    as_json = runner.invoke(app, ["runs", "list", "--store", str(tmp_path), "--json"])
    assert as_json.exit_code == 0, as_json.output
    [row] = json.loads(as_json.stdout)
    assert row["run_id"] == run_id and row["experiment"] == experiment
    assert row["config_hash"] == "cd" * 32 and row["stages"] == 1

    shown_json = runner.invoke(app, ["runs", "show", run_id, "--store", str(tmp_path), "--json"])
    assert shown_json.exit_code == 0, shown_json.output
    run = json.loads(shown_json.stdout)
    assert run["run_id"] == run_id and run["config_hash"] == "cd" * 32
    [pre] = run["stages"]
    assert pre["stage"] == "preprocess" and pre["manifest"].endswith("/preprocess/manifest.json")
    [f] = pre["files"]
    assert f["name"].endswith("would-ellipsize.json") and f["rows"] is None and f["size"] > 0
    assert f["uri"].startswith("file://")
