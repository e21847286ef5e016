"""Code-execution reward: run a completion's code against its row's tests in the sandbox.

A row's tests (``reward_model.ground_truth``) are Python source, MBPP style: ``assert`` statements,
optionally preceded by set-up statements (imports, helpers)::

    assert add(1, 2) == 3
    assert add(-1, 1) == 0

Each top-level ``assert`` is one test; every other top-level statement is set-up, run once after the
solution. The solution is the last ```` ```python ```` (or ```` ```py ````) fenced block of the response,
else the whole response.

One sandbox run per sample: a harness runs the solution, the set-up, then each assert on its own
(a failing or raising assert fails that test only) and reports each test on a line
``<nonce> <i> pass|fail`` written to a private copy of stdout; the code's own stdout goes to
``/dev/null``. The nonce is random per run and the harness deletes its own source file before the
solution runs, so a response that prints a made-up summary (it cannot know the nonce) earns nothing.
What this does not defend against: code that introspects the interpreter at run time to find the
nonce, and objects whose ``__eq__`` always returns True (the asserts then pass, as they would for
any test runner executing the code).

Tests reported before a timeout or crash count; the rest fail.
"""

from __future__ import annotations

import ast
import re
import secrets
from typing import Literal, NamedTuple

from verl_core.runtime.sandbox import SandboxResult, SandboxSpec, run_python

CodeScore = Literal["fraction", "all"]

_FENCE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)

_HARNESS = """\
import os as _os
_os.remove(__file__)  # the nonce below is gone from the file system before the solution runs
_out = _os.dup(1)
_null = _os.open(_os.devnull, _os.O_WRONLY)
_os.dup2(_null, 1)
_NONCE = {nonce!r}
_g = {{"__name__": "__main__"}}
try:
    exec(compile({solution!r}, "solution.py", "exec"), _g)
    exec(compile({setup!r}, "tests.py", "exec"), _g)
except BaseException as _e:  # SystemExit too: the solution may not end the run
    import traceback as _tb
    _tb.print_exc()
    _os.write(_out, ("%s setup fail\\n" % _NONCE).encode())
    _os._exit(0)
for _i, _t in enumerate({tests!r}):
    try:
        exec(compile(_t, "tests.py", "exec"), _g)
        _ok = "pass"
    except BaseException:
        _ok = "fail"
    _os.write(_out, ("%s %d %s\\n" % (_NONCE, _i, _ok)).encode())
_os.write(_out, ("%s done\\n" % _NONCE).encode())
_os._exit(0)
"""


class CodeTests(NamedTuple):
    """A row's tests split into set-up source and one source string per assert."""

    setup: str
    asserts: list[str]


class CodeRun(NamedTuple):
    """One sample's verdict: ``passed`` of ``total`` asserts; ``failure`` says why the code did not
    finish its tests (None: it did): its crash, a timeout, a limit hit."""

    passed: int
    total: int
    failure: str | None
    result: SandboxResult


def extract_code(response: str) -> str:
    """The last ```python fenced block of ``response``, else all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(source: str) -> CodeTests:
    """Split MBPP-style test source into set-up and asserts. Raises ValueError when it does not parse
    or has no assert (the row is unusable, not the response)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ValueError(f"the row's tests do not parse: {e}") from None
    setup = [ast.get_source_segment(source, s) or "" for s in tree.body if not isinstance(s, ast.Assert)]
    asserts = [ast.get_source_segment(source, s) or "" for s in tree.body if isinstance(s, ast.Assert)]
    if not asserts:
        raise ValueError("the row's tests have no assert statement")
    return CodeTests("\n".join(setup), asserts)


def harness(solution: str, tests: CodeTests, nonce: str) -> str:
    """The program one sandbox run executes (see the module docstring)."""
    return _HARNESS.format(nonce=nonce, solution=solution, setup=tests.setup, tests=tests.asserts)


def _verdicts(stdout: str, nonce: str, total: int) -> tuple[set[int], bool, bool]:
    """Passed test indices, whether set-up failed and whether the harness finished, from the lines that
    carry ``nonce`` (any other line, e.g. a forged summary, is ignored)."""
    passed: set[int] = set()
    setup_failed = done = False
    for line in stdout.splitlines():
        words = line.split()
        if not words or words[0] != nonce:
            continue
        if words[1:] == ["setup", "fail"]:
            setup_failed = True
        elif words[1:] == ["done"]:
            done = True
        elif len(words) == 3 and words[1].isdigit() and int(words[1]) < total and words[2] == "pass":
            passed.add(int(words[1]))
    return passed, setup_failed, done


def run_tests(response: str, tests: CodeTests, spec: SandboxSpec) -> CodeRun:
    """Run the response's code against ``tests`` in one sandbox run."""
    nonce = secrets.token_hex(16)
    result = run_python(harness(extract_code(response), tests, nonce), spec)
    passed, setup_failed, done = _verdicts(result.stdout, nonce, len(tests.asserts))
    failure: str | None = None
    if result.killed_reason is not None:
        failure = result.killed_reason
    elif setup_failed:
        last = result.stderr.strip().splitlines()[-1:] or ["?"]
        failure = f"the code raised before the tests: {last[0][:200]}"
    elif not done:
        failure = f"the code ended the run (exit code {result.exit_code})"
    return CodeRun(len(passed), len(tests.asserts), failure, result)


def code_score(run: CodeRun, mode: CodeScore) -> float:
    """``fraction``: passed / total; ``all``: 1.0 only when every assert passed."""
    if mode == "all":
        return float(run.passed == run.total)
    return run.passed / run.total
