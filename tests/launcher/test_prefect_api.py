"""``api_failure``: the one line for a run whose Prefect API stopped answering mid-run, found however
deep the connection error sits in the chain of exceptions (Prefect re-raises; the pipeline's finish-run
fails during the handling of the first error); other errors are left to the caller."""

from __future__ import annotations

import httpx
import pytest

from launcher.prefect_api import api_failure


def _raised_during(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception:
            raise outer  # noqa: B904 - implicit chaining (__context__) is the point
    except Exception as e:
        return e


def test_a_connection_error_anywhere_in_the_chain_names_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4321/api")
    refused = httpx.ConnectError("All connection attempts failed")
    line = api_failure(_raised_during(RuntimeError("finish-run failed"), refused))
    assert line is not None and "\n" not in line
    assert line.startswith(
        "the Prefect API http://127.0.0.1:4321/api (from the environment variable PREFECT_API_URL) "
        "stopped answering mid-run (ConnectError: All connection attempts failed)"
    )
    assert "`infra/local/prefect_server.sh 4321`" in line and "rerun the same command to resume" in line
    wrapped = RuntimeError("task failed")
    wrapped.__cause__ = httpx.ReadTimeout("timed out")
    assert "(ReadTimeout: timed out)" in (api_failure(wrapped) or "")


def test_other_errors_are_not_blamed_on_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4321/api")
    assert api_failure(ValueError("bad row 3")) is None
    assert api_failure(_raised_during(KeyError("x"), ValueError("y"))) is None
