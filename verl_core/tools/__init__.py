"""Tools a model can call in a multi-turn rollout, chosen by name (``rollout.multi_turn.tools``).

A :class:`Tool` is a name, an OpenAI function schema (JSON schema of the arguments) and a callable
``(**arguments) -> str``. Built-ins register themselves in :data:`TOOLS`: ``calculator``, and ``python``,
which runs code in the sandbox that ``load_tools(..., sandbox=)`` binds. User tools are
``package.module:function`` paths whose function carries a ``schema`` attribute (see :func:`load_tool`)."""

from verl_core.tools.calculator import calculate
from verl_core.tools.python import run_code
from verl_core.tools.registry import (
    TOOLS,
    Tool,
    ToolResult,
    call_tool,
    load_tool,
    load_tools,
    register_tool,
    tool_schema,
)

__all__ = [
    "TOOLS",
    "Tool",
    "ToolResult",
    "calculate",
    "call_tool",
    "load_tool",
    "load_tools",
    "register_tool",
    "run_code",
    "tool_schema",
]
