"""``verl-flow doctor`` flags the installed Prefect/SQLAlchemy pair whose scheduler creates no flow runs
(:data:`verl_core.runtime.doctor.KNOWN_BAD`); the versions are faked through the metadata lookup."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flows.cli import app
from verl_core.runtime import doctor

runner = CliRunner()
REAL_VERSION = doctor.installed_version


def _row(stdout: str) -> str:
    [row] = [line for line in stdout.splitlines() if "prefect + sqlalchemy" in line]
    return row


def test_doctor_fails_on_prefect_with_sqlalchemy_2_1(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {"prefect": "3.8.8", "sqlalchemy": "2.1.9"}  # the pair whose scheduler crashes every loop
    monkeypatch.setattr(doctor, "installed_version", lambda d: fake.get(d) or REAL_VERSION(d))
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 1, result.output
    assert "error" in _row(result.stdout)
    [line] = [x for x in result.stderr.splitlines() if "sqlalchemy" in x]
    assert line.startswith("error: prefect + sqlalchemy: prefect 3.8.8, sqlalchemy 2.1.9: Prefect's")
    assert line.endswith("fix: pip install 'sqlalchemy<2.1' (constraints.txt pins it)")


def test_doctor_passes_the_pinned_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {"prefect": "3.8.8", "sqlalchemy": "2.0.58"}  # below 2.1: the scheduler works
    monkeypatch.setattr(doctor, "installed_version", lambda d: fake.get(d) or REAL_VERSION(d))
    result = runner.invoke(app, ["doctor"])
    assert "│ ok " in _row(result.stdout) and "prefect 3.8.8, sqlalchemy 2.0.58" in _row(result.stdout)
    assert "sqlalchemy" not in result.stderr


def test_this_environment_holds_the_pin() -> None:
    """constraints.txt applied by the Makefile: the installed pair is not the known-bad one."""
    [row] = [c for c in doctor.known_bad_checks() if c.name == "prefect + sqlalchemy"]
    assert row.status == "ok", row.line()
