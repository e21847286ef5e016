"""``verl-flow rescore``: what it refuses in one line before the flow starts, and the flow's parameters
as a deployment shows them (the rescore itself: tests/stages/test_rescore.py on hand-made rows,
tests/reliability/test_rescore.py end to end with a kill)."""

from __future__ import annotations

from pathlib import Path

from prefect.utilities.callables import parameter_schema
from typer.testing import CliRunner

from flows.cli import app
from flows.rescore import rescore_flow

runner = CliRunner()


def _refused(tmp_path: Path, *args: str) -> tuple[int, list[str]]:
    result = runner.invoke(app, ["rescore", "some-run", "--store", str(tmp_path), *args])
    assert "Traceback" not in result.output
    return result.exit_code, result.stderr.strip().splitlines()


def test_refusals_are_one_line_before_any_work(tmp_path: Path) -> None:
    assert _refused(tmp_path, "reward.gsm8k_method=flexible", "actor.lr=1e-3") == (
        2,
        ["error: 'actor.lr': a rescore changes only reward.* and sandbox.* settings (the rollouts are the "
         "run's own)"],
    )  # fmt: skip
    assert _refused(tmp_path, "--iterations", "7:3") == (
        2,
        ["error: --iterations: got '7:3', expected A:B (iterations A <= i < B), A:, :B or N"],
    )
    assert _refused(tmp_path, "--name", "a/b") == (
        2,
        ["error: --name: got 'a/b', expected letters, digits, '_', '.', '=' or '-'"],
    )
    code, lines = _refused(tmp_path)
    assert code == 1 and len(lines) == 1 and "run.json does not exist" in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_flow_parameters_are_typed_for_the_deployment() -> None:
    schema = parameter_schema(rescore_flow).model_dump()
    props = schema["properties"]
    assert schema["required"] == ["run_id"]
    assert props["run_id"]["type"] == "string"
    assert props["overrides"]["anyOf"][0] == {"items": {"type": "string"}, "type": "array"}
    for name in ("iterations", "name", "store_url"):
        assert props[name]["anyOf"][0] == {"type": "string"}, name
