"""Progress lines of the stage flows copied into the pipeline flow run's logs (:mod:`flows.progress`);
end to end, against a Prefect server: tests/flows/test_prefect_ui_browser.py."""

from __future__ import annotations

import logging

import pytest

from flows import progress


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_stage_lines_come_at_most_every_interval() -> None:
    every = progress.STAGE_LINE_EVERY_S
    # first line of a run: logged; within the interval: not; after it: logged; runs are separate
    assert progress.stage_line("p1", "rl: iteration 1/9: rollout", now=1000.0)
    assert not progress.stage_line("p1", "rl: iteration 1/9: reward", now=1000.0 + every / 2)
    assert progress.stage_line("p1", "rl: iteration 1/9: update", now=1000.0 + every)
    assert progress.stage_line("p2", "rl: iteration 1/9: rollout", now=1000.0 + every)


def test_only_progress_lines_go_to_the_parent_flow_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "_parent_flow_run_id", lambda: "parent-run")
    loggers = [logging.getLogger(name) for name in progress.RUN_LOGGERS]
    before = [list(logger.handlers) for logger in loggers]
    with progress.to_pipeline():
        [handler] = {h for logger in loggers for h in logger.handlers if isinstance(h, progress._ToPipeline)}
        sent = Collect()
        handler.api = sent  # type: ignore[assignment]  # instead of Prefect's API log handler
        lines = [
            "sft: step 40/126 loss=1.2",
            "rl: iteration 3/10: reward",
            "rl: iteration 3/10 done, val accuracy 0.5",
            "reward: iteration 2, 16 rows",  # a stage's own figures: stay in the stage flow run's log
            "Finished in state Completed()",
        ]
        for line in lines:
            handler.emit(logging.makeLogRecord({"msg": line, "flow_run_id": "own", "task_run_id": "task"}))
    assert [r.getMessage() for r in sent.records] == lines[:3]
    assert {(r.flow_run_id, r.task_run_id) for r in sent.records} == {("parent-run", None)}  # type: ignore[attr-defined]
    assert [list(logger.handlers) for logger in loggers] == before  # removed on exit


def test_a_flow_run_started_on_its_own_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "_parent_flow_run_id", lambda: None)
    with progress.to_pipeline():
        handlers = [h for name in progress.RUN_LOGGERS for h in logging.getLogger(name).handlers]
        assert not [h for h in handlers if isinstance(h, progress._ToPipeline)]


def test_a_dispatched_runs_progress_is_echoed_on_the_console_once(caplog: pytest.LogCaptureFixture) -> None:
    """``verl-flow run`` in deployments mode: each poll prints the dispatched flow run's new progress
    lines (flows.dispatch.echo_progress), console only (the flow run sends its own copy to the API)."""
    import uuid
    from datetime import datetime, timedelta, timezone
    from types import SimpleNamespace
    from typing import Any

    from flows.dispatch import echo_progress

    lines = [(1, "sft: step 10/40 loss=2.0"), (2, "Finished in state Completed()"), (3, "sft: step 20/40")]
    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def at(i: int) -> datetime:
        return t0 + timedelta(seconds=i)

    logs = [SimpleNamespace(timestamp=at(t), message=m) for t, m in lines]
    child = uuid.uuid4()
    asked: list[Any] = []

    class Client:
        def read_logs(self, log_filter: Any, **_: Any) -> list[Any]:
            after = log_filter.timestamp.after_ if log_filter.timestamp else None
            asked.append(after)
            return [x for x in logs if after is None or x.timestamp >= after]  # the API: at or after

    with caplog.at_level(logging.INFO):
        last = echo_progress(Client(), child, None)
        assert last == at(3)
        logs.append(SimpleNamespace(timestamp=at(4), message="sft: step 30/40"))
        assert echo_progress(Client(), child, last) == at(4)
    echoed = [r for r in caplog.records if r.name == "flows.dispatch"]
    assert [r.getMessage() for r in echoed] == [
        "sft: step 10/40 loss=2.0",
        "sft: step 20/40",
        "sft: step 30/40",
    ]
    assert asked == [None, at(3)] and all(r.send_to_api is False for r in echoed)  # type: ignore[attr-defined]
