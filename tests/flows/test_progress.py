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
