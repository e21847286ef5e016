"""The ``python`` tool: registered like the calculator, bound to the run's sandbox by load_tools."""

from __future__ import annotations

import pytest

from stages.floor.rollouts import generate_rollouts
from verl_core.config import MultiTurnConfig
from verl_core.errors import ConfigError
from verl_core.runtime import sandbox
from verl_core.runtime.sandbox import SandboxSpec
from verl_core.tools import call_tool, load_tools

BWRAP_PROBLEM = sandbox.bwrap_problem()
SPEC = SandboxSpec("bwrap", timeout_s=5.0, cpu_time_s=5, memory_mb=256, max_processes=16,
                   max_output_bytes=4096, max_file_mb=4)  # fmt: skip


def test_its_schema_is_listed_without_a_sandbox() -> None:
    tool = load_tools(["python"])["python"]
    assert tool.needs_sandbox
    assert tool.openai_schema()["function"]["parameters"]["required"] == ["code"]
    # unbound (schemas only, e.g. for the prompts' tool list): a call is an error the model reads
    result = call_tool({"python": tool}, "python", {"code": "print(1)"})
    assert result.error is not None and "without a sandbox" in result.error


@pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"bubblewrap cannot run here ({BWRAP_PROBLEM})")
def test_bound_to_the_sandbox_it_runs_code_and_reports_limits() -> None:
    tools = load_tools(["calculator", "python"], sandbox=SPEC)
    assert call_tool(tools, "python", {"code": "print(6 * 7)"}).text.strip() == "42"
    hung = call_tool(tools, "python", {"code": "while True: pass"}).text
    assert hung.startswith("error:")  # the model reads the timeout / CPU limit, the rollout goes on
    # the model may only pass the schema's arguments: the sandbox spec is not one of them
    assert call_tool(tools, "python", {"code": "print(1)", "spec": None}).error is not None


def test_a_rollout_with_python_needs_the_sandbox_settings() -> None:
    mt = MultiTurnConfig(enable=True, tools=["python"])
    with pytest.raises(ConfigError, match="needs the sandbox settings"):
        generate_rollouts(None, None, [[1]], None, mt, 8, sandbox=None)  # type: ignore[arg-type]
