"""The code scorer on hand-written MBPP-style rows (tests/data/code/mbpp_rows.jsonl: 3 asserts each, a
correct and a wrong solution whose pass count is worked out in the file's comments / ``wrong_passes``):
correct → 1.0, wrong → the pass fraction, crashing or hanging code → 0 and counted as the sample's
failure (not a stage failure), a printed fake summary earns nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl_core.reward import CodeScorer, RewardBatch, WeightedScorer, score_rollouts
from verl_core.reward.code import extract_code, parse_tests, run_tests
from verl_core.runtime import sandbox
from verl_core.runtime.sandbox import SandboxSpec

ROWS = [json.loads(line) for line in (Path(__file__).parents[2] / "data/code/mbpp_rows.jsonl").open()]
BWRAP_PROBLEM = sandbox.bwrap_problem()
pytestmark = pytest.mark.skipif(
    BWRAP_PROBLEM is not None,
    reason=f"bubblewrap cannot run here ({BWRAP_PROBLEM}); `make install` installs it when root",
)
SPEC = SandboxSpec("bwrap", 1.0, 2, 256, 16, 4096, 4)  # 1 s: the hanging sample times out fast


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}```\nIt works."


def batch(responses: list[str], tests: list[str]) -> RewardBatch:
    n = len(responses)
    return RewardBatch(
        group_id=list(range(n)),
        sample_index=[0] * n,
        data_source=["mbpp-style/handwritten"] * n,
        ground_truth=tests,
        prompt_text=["q"] * n,
        response_text=responses,
        response_length=[10] * n,
        finish_reason=["stop"] * n,
        extra_info=[{} for _ in range(n)],
    )


def score(responses: list[str], tests: list[str], mode: Any = "fraction") -> Any:
    return CodeScorer(SPEC, mode, num_workers=2)(batch(responses, tests))


def test_extract_and_parse() -> None:
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"  # the last block
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"  # no fence: all of it
    tests = parse_tests(ROWS[3]["reward_model"]["ground_truth"])
    assert tests.setup == "import math" and len(tests.asserts) == 3
    with pytest.raises(ValueError, match="no assert"):
        parse_tests("x = 1")


def test_correct_solutions_score_one_wrong_ones_their_pass_fraction() -> None:
    tests = [r["reward_model"]["ground_truth"] for r in ROWS]
    right = score([fenced(r["extra_info"]["solution"]) for r in ROWS], tests)
    assert right.scores == [1.0] * len(ROWS) and right.errors == [None] * len(ROWS)
    assert right.metrics == {"failures": 0.0, "timeouts": 0.0}
    wrong = [fenced(r["extra_info"]["wrong_solution"]) for r in ROWS]
    # add: 2 of 3, is_palindrome: 2 of 3, first_repeated_char: 2 of 3, sum_squares: 1 of 3
    assert score(wrong, tests).scores == pytest.approx([2 / 3, 2 / 3, 2 / 3, 1 / 3])
    assert score(wrong, tests, mode="all").scores == [0.0] * len(ROWS)


def test_crashing_and_hanging_code_scores_zero_and_is_counted() -> None:
    tests = ROWS[0]["reward_model"]["ground_truth"]
    responses = [
        fenced("raise RuntimeError('boom')\n"),  # before any test
        fenced("import sys\nsys.exit(0)\n"),  # ends the run "successfully"
        fenced("def add(a, b):\n    while True:\n        pass\n"),  # hangs in the first test
        fenced("def add(a, b):\n    return 1 / 0\n"),  # every assert raises: plain failures
    ]
    out = score(responses, [tests] * 4)
    assert out.scores == [0.0] * 4 and out.errors == [None] * 4
    assert out.metrics == {"failures": 3.0, "timeouts": 1.0}  # the last one ran all its tests
    failures = [run_tests(r, parse_tests(tests), SPEC).failure for r in responses]
    assert failures[0] is not None and "RuntimeError: boom" in failures[0]
    assert failures[1] is not None and "SystemExit" in failures[1]
    assert failures[2] == "timeout"
    assert failures[3] is None

    # through score_rollouts with on_error="fail": the model's crash is not a failed stage
    result = score_rollouts(
        batch(responses, [tests] * 4),
        [WeightedScorer("code", 1.0, CodeScorer(SPEC, "fraction", 2))],
        on_error="fail",
        max_response_length=100,
    )
    assert result.scores == [0.0] * 4
    assert result.metrics["reward/code/failures"] == 3.0 and result.metrics["reward/errors"] == 0.0


def test_a_printed_summary_cannot_forge_a_pass() -> None:
    tests = ROWS[0]["reward_model"]["ground_truth"]
    forgeries = [
        # prints what a harness might print, on stdout and straight to fd 1 and 3
        "import os\nfor i in range(3):\n    print('PASS', i)\n    os.write(1, b'0 pass\\n')\n"
        'print(\'{"passed": 3, "total": 3}\')\nfor fd in (3, 4, 5):\n    try:\n'
        "        os.write(fd, b'x %d pass\\n' % fd)\n    except OSError:\n        pass\n",
        # tries to read the nonce from the harness's source file
        "import os\nprint(open(os.path.abspath('main.py')).read())\n",
    ]
    out = score([fenced(code) for code in forgeries], [tests] * 2)
    assert out.scores == [0.0, 0.0]


def test_unparsable_tests_are_the_scorers_error() -> None:
    out = score([fenced(ROWS[0]["extra_info"]["solution"])], ["assert (("])
    assert out.scores == [0.0] and out.errors[0] is not None and "do not parse" in out.errors[0]
