"""``verl-flow rescore`` with a reward function as a verl user writes it: verl's documented signature
``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, given by file path (verl's
``custom_reward_function.path`` + ``.name``), on a hand-made run scored by the built-in GSM8K rule.
It agrees with the rule on every row; a function that fails deterministically fails the rescore in
one line, without Prefect's retries or tracebacks; one that cannot load fails before the flow starts."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from flows.cli import app
from stages.floor.locations import iteration_stage
from stages.reward import reward
from verl_core.config import VerlFlowConfig
from verl_core.runtime.run import RunContext

RUN = "hand"
# the run's own reward: the default rule scorer, GSM8K strict ('#### N'); tracking off; retries on
CFG = VerlFlowConfig.model_validate({"tracking": {"enabled": False}, "execution": {"retry_delay_s": 0}})
# (response, ground truth): strict reads the last '#### N'
ROWS = [
    ("3 + 4 = 7\n#### 7", "7"),  # right
    ("The answer is 7", "7"),  # no '####': no answer, wrong
    ("#### 8", "7"),  # wrong
    ("#### 1,234", "1234"),  # right: commas are dropped
    ("#### 5\nmore #### 6", "6"),  # the last one counts: right
]
# verl's signature, written for this test: the strict GSM8K rule (last '#### N', commas dropped)
VERL_STYLE = """
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"#### (\\-?[0-9\\.\\,]+)", solution_str)
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "") == ground_truth else 0.0

def fails_on_real_rows(data_source, solution_str, ground_truth, extra_info=None):
    with open(extra_info_path(), "a") as f:
        f.write("called\\n")
    if ground_truth == "1":  # the preflight's synthetic row
        return 1.0
    return int(solution_str)  # ValueError on every real row: a retry cannot help

def extra_info_path():
    import os
    return os.environ["VERL_FLOW_TEST_CALLS"]
"""


def _rollouts() -> pa.Table:
    n = len(ROWS)
    return pa.table(
        {
            "iteration": [0] * n, "group_id": list(range(n)), "sample_index": [0] * n,
            "prompt_index": list(range(n)), "data_source": ["openai/gsm8k"] * n,
            "ground_truth": [t for _, t in ROWS], "prompt_text": [f"question {i}" for i in range(n)],
            "prompt_ids": [[1, 2]] * n, "response_ids": [[3]] * n, "response_text": [r for r, _ in ROWS],
            "logprobs": [[-0.5]] * n, "finish_reason": ["stop"] * n, "prompt_length": [2] * n,
            "response_length": [1] * n, "policy_version": [0] * n, "is_baseline": [False] * n,
            "loss_mask": pa.nulls(n, pa.list_(pa.int8())), "turns": pa.nulls(n),
        }
    )  # fmt: skip


@pytest.fixture
def run_store(tmp_path: Path) -> str:
    """A run of one iteration whose rollouts the built-in rule scored (the real reward stage)."""
    ctx = RunContext(run_id=RUN, store_url=str(tmp_path / "store"))
    store = ctx.store()
    store.write_run_record(RUN, CFG.model_dump(mode="json"), CFG.config_hash())
    stage = store.open_stage(RUN, iteration_stage(0, "rollout"))
    stage.write_table("rollouts.parquet", _rollouts(), "rollouts")
    uri = stage.commit(summary={"seconds": 1.0})
    reward.fn(ctx, CFG.reward, uri, 0, CFG.data.max_response_length, sandbox=CFG.sandbox)
    return ctx.store_url


def _rescore(store_url: str, function: str, name: str) -> object:
    args = ["rescore", RUN, "--store", store_url, "--name", name, "reward.scorers=[function]"]
    return CliRunner().invoke(app, [*args, f"reward.function={function}"])


def test_a_verl_function_by_file_path_agrees_with_the_gsm8k_rule(
    run_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "my_reward.py").write_text(VERL_STYLE)
    monkeypatch.chdir(tmp_path / "work")  # the path is relative to the working directory, as in verl
    result = _rescore(run_store, "my_reward.py:compute_score", "verl")
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    from verl_core.store import ArtifactStore

    report = ArtifactStore(run_store).committed(RUN, "rescore/verl/report")
    assert report is not None
    total = report.summary["total"]
    # rows 0, 3, 4 right and 1, 2 wrong under both: the correct flags agree on 5 of 5
    assert total["agreement"] == 1.0 and total["rows"] == len(ROWS)
    assert (total["tt"], total["ff"], total["scores_changed"]) == (3, 2, 0)  # the same scores too


def test_a_deterministic_scorer_error_fails_once_in_one_line(
    run_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("VERL_FLOW_TEST_CALLS", str(calls))
    (tmp_path / "fns.py").write_text(VERL_STYLE)
    result = _rescore(run_store, f"{tmp_path / 'fns.py'}:fails_on_real_rows", "fails")
    assert result.exit_code == 1  # type: ignore[attr-defined]
    lines = result.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "ValueError: invalid literal for int()" in lines[0] and "(full log: " in lines[0]
    assert "Traceback" not in result.output  # type: ignore[attr-defined]
    # one call on the preflight's synthetic row, then one per row of one attempt (sample mode scores
    # every row before the stage fails): execution.task_retries=2 would make it 1 + 3 x 5
    assert calls.read_text().count("called") == 1 + len(ROWS)


def test_a_function_that_cannot_load_fails_before_the_flow(run_store: str, tmp_path: Path) -> None:
    result = _rescore(run_store, "nosuchmod:f", "none")
    assert result.exit_code == 2  # type: ignore[attr-defined]
    assert result.stderr.strip().splitlines() == [  # type: ignore[attr-defined]
        "error: reward.function: cannot import module 'nosuchmod' (No module named 'nosuchmod'); put "
        "its directory on PYTHONPATH, or give the file: 'path/to/file.py:f'"
    ]
    from verl_core.store import ArtifactStore

    assert ArtifactStore(run_store).committed(RUN, "rescore/none/report") is None
