"""The test session's environment (tests/conftest.py): a developer's shell cannot change where the
tests' MLflow runs land."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import MLFLOW_WHERE_ENV

ROOT = Path(__file__).resolve().parents[1]


def test_mlflow_location_variables_are_cleared() -> None:
    assert [k for k in MLFLOW_WHERE_ENV if k in os.environ] == []


def test_a_shell_with_mlflow_variables_set_does_not_reach_the_tests() -> None:
    # The check above, in a pytest started from a shell that exports every variable: before the
    # conftest cleared them, it failed there (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, ... listed).
    env = {**os.environ, **{k: "http://mlflow.example:5000" for k in MLFLOW_WHERE_ENV}}
    test = f"{Path(__file__).relative_to(ROOT)}::test_mlflow_location_variables_are_cleared"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
