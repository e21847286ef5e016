"""A custom reward function is checked before any work: ``verl-flow doctor --config``, ``verl-flow run``
and the stage flows' environment check import it, fit its signature and score one synthetic row
(stages.floor.environment.scorer_checks). Before: ``reward.function=nosuchmod:f`` passed the config
check and doctor, and the run failed at the first validation, after SFT."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from stages.floor.environment import check_environment, scorer_checks
from verl_core.config import load_config
from verl_core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
NOSUCH = ["reward.scorers=[function]", "reward.function=nosuchmod:f"]
IMPORT_ERROR = (
    "error: reward.function: cannot import module 'nosuchmod' (No module named 'nosuchmod'); put its "
    "directory on PYTHONPATH, or give the file: 'path/to/file.py:f'"
)
runner = CliRunner()


def test_run_refuses_a_function_that_cannot_load_in_one_line_before_any_work(tmp_path: Path) -> None:
    store = tmp_path / "store"
    result = runner.invoke(app, ["run", QUICKSTART, f"store.url={store}", *NOSUCH])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [IMPORT_ERROR]
    assert not store.exists()  # nothing was written: no preprocess, no SFT


def test_doctor_reports_the_function(tmp_path: Path) -> None:
    bad = runner.invoke(app, ["doctor", "--config", QUICKSTART, f"store.url={tmp_path}", *NOSUCH])
    assert bad.exit_code == 1
    assert bad.stderr.strip().splitlines() == [IMPORT_ERROR]
    good_file = tmp_path / "verl_reward.py"
    good_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str.endswith(ground_truth))\n"
    )
    spec = f"reward.function={good_file}:compute_score"
    good = runner.invoke(app, ["doctor", "--config", QUICKSTART, f"store.url={tmp_path}", NOSUCH[0], spec])
    assert good.exit_code == 0, good.output
    row = next(line for line in good.stdout.splitlines() if "reward.function" in line)
    assert "ok" in row and "scored a synthetic row" in row


def test_signature_and_synthetic_row_problems_are_errors_row_faults_warnings(tmp_path: Path) -> None:
    fns = tmp_path / "fns.py"
    fns.write_text(
        "def two_args(a, b):\n    return 1.0\n"
        "def text(completion, **kw):\n    return 'high'\n"
        "def wants_level(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(extra_info['level'] == 'easy')\n"
    )

    def check(name: str) -> tuple[str, str]:
        cfg = load_config(QUICKSTART, [NOSUCH[0], f"reward.function={fns}:{name}"])
        [c] = scorer_checks(cfg)
        return c.status, c.found

    status, found = check("two_args")
    assert status == "error" and "does not fit reward.function_mode=sample" in found
    status, found = check("text")
    assert status == "error" and "returned 'high', expected a number" in found
    # the synthetic row carries verl's gsm8k extra_info (split, index, answer, question), not a dataset's
    # own keys: real rows may carry extra_info['level'], so a KeyError there is a warning
    status, found = check("wants_level")
    assert status == "warn" and "KeyError: 'level'" in found


def test_the_stage_flows_environment_check_refuses_it_too() -> None:
    with pytest.raises(ConfigError, match=r"reward\.function: cannot import module 'nosuchmod'"):
        check_environment(load_config(QUICKSTART, NOSUCH))
    assert scorer_checks(load_config(QUICKSTART)) == []  # the rule scorer: nothing to import
