"""The ``python`` tool: the model's code runs in the sandbox (:mod:`verl_core.runtime.sandbox`), and the model
reads its stdout, or the error (``error: timeout after 5 s``, ``error: killed: memory limit``, the end
of stderr). Timeouts, crashes and limit hits are the tool's answer, never a failed rollout.

The limits come from the run's ``sandbox.*`` settings, so the registered tool is *unbound*: its
callable needs a :class:`~verl_core.runtime.sandbox.SandboxSpec`, which :func:`verl_core.tools.load_tools`
binds (``sandbox=``) where the rollout is built. Unbound (only its schema used, e.g. to list the
tools in the prompts) it answers every call with an error.
"""

from __future__ import annotations

from verl_core.runtime.sandbox import SandboxSpec, python_tool
from verl_core.tools.registry import Tool, register_tool


def run_code(code: str, spec: SandboxSpec | None = None) -> str:
    """The tool's callable: ``code`` run under ``spec`` (bound by ``load_tools``)."""
    if spec is None:
        raise RuntimeError("the python tool was built without a sandbox (load_tools(..., sandbox=spec))")
    return python_tool(code, spec)


PYTHON = register_tool(
    Tool(
        name="python",
        description=(
            "Run Python 3 code (standard library only, no network, no files outside a scratch "
            "directory) and return what it prints."
        ),
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source; print() the result"}},
            "required": ["code"],
        },
        fn=run_code,
        needs_sandbox=True,
    )
)
