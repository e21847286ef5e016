"""The tool registry: a tool is a name, an OpenAI function schema and a callable returning text.

A tool's ``parameters`` is the JSON schema of its arguments (OpenAI "function" format), shown to the
model in the chat template's tool list (``tools=`` of the Qwen2.5 / Hermes template). A call is
``fn(**arguments) -> str``; whatever goes wrong (bad arguments, a raise, a non-string return) becomes
the tool's *error text*, which the model reads as the tool's answer: a tool never fails a rollout.

Two ways to provide a tool:

1. built-in, registered by name::

       register_tool(Tool("calculator", "Evaluate an arithmetic expression", {...json schema...}, calculate))

2. a user function named ``package.module:function`` in ``rollout.multi_turn.tools``, carrying its
   schema as a ``schema`` attribute (the OpenAI ``{"type": "function", "function": {...}}`` dict or
   just its inner ``{"name", "description", "parameters"}``); :func:`tool_schema` attaches it::

       @tool_schema({"name": "lookup", "description": "...", "parameters": {...}})
       def lookup(key: str) -> str: ...

   The schema's ``name`` is the name the model calls (it may differ from the Python name).

Arguments are checked against the schema before the call (required properties, no unknown
properties, JSON types of the declared properties) - enough to turn a model's malformed call into a
readable error; a tool validates the values it cares about itself. Calls run in-process without a
timeout: a tool that may hang (code execution) enforces its own limits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from verl_core.errors import ConfigError
from verl_core.registry import Registry, UnknownNameError
from verl_core.reward.functions import load_reward_function

if TYPE_CHECKING:
    from verl_core.runtime.sandbox import SandboxSpec

ToolFn = Callable[..., str]


@dataclass(frozen=True)
class Tool:
    """name: what the model calls; parameters: JSON schema (type "object") of the arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: ToolFn = field(compare=False)
    needs_sandbox: bool = False  # fn takes a ``spec`` keyword (the sandbox it runs code in)

    def bound(self, sandbox: SandboxSpec) -> Tool:
        """This tool with ``sandbox`` as the ``spec`` of a tool that runs code (others unchanged)."""
        return replace(self, fn=partial(self.fn, spec=sandbox)) if self.needs_sandbox else self

    def openai_schema(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}`` (``tools=``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


class ToolResult(NamedTuple):
    """text: what the model reads (the error text when the call failed); error: None or the error."""

    text: str
    error: str | None
    latency_s: float


TOOLS: Registry[Tool] = Registry("tool")


def register_tool(tool: Tool) -> Tool:
    """Register a built-in ``tool`` under ``tool.name`` (a name registers once)."""
    _check_schema(tool.parameters, tool.name)
    return TOOLS.register(tool.name)(tool)


def tool_schema(schema: Mapping[str, Any]) -> Callable[[ToolFn], ToolFn]:
    """Decorator attaching an OpenAI function ``schema`` to a user tool function (see module doc)."""

    def attach(fn: ToolFn) -> ToolFn:
        fn.schema = dict(schema)  # type: ignore[attr-defined]
        return fn

    return attach


def load_tool(spec: str) -> Tool:
    """The tool named ``spec``: a registered name, or ``package.module:function`` with a ``schema``."""
    if ":" not in spec:
        try:
            return TOOLS.get(spec)
        except UnknownNameError as e:
            raise ConfigError(f"rollout.multi_turn.tools: {e} (or give 'package.module:function')") from None
    try:
        fn = load_reward_function(spec)
    except ConfigError as e:
        raise ConfigError(str(e).replace("reward.function", "rollout.multi_turn.tools")) from None
    schema = getattr(fn, "schema", None)
    if not isinstance(schema, Mapping):
        raise ConfigError(
            f"rollout.multi_turn.tools: {spec!r} has no 'schema' attribute (an OpenAI function schema "
            "dict); attach one with verl_core.tools.tool_schema"
        )
    inner = schema.get("function", schema) if schema.get("type") == "function" else schema
    name, parameters = inner.get("name"), inner.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(name, str) or not name:
        raise ConfigError(f"rollout.multi_turn.tools: the schema of {spec!r} has no 'name'")
    _check_schema(parameters, spec)
    return Tool(name, str(inner.get("description", "")), parameters, fn)


def load_tools(specs: Sequence[str], sandbox: SandboxSpec | None = None) -> dict[str, Tool]:
    """``{name the model calls: tool}`` for the configured tool specs; two tools with one name fail.
    Tools that run code (``needs_sandbox``) get ``sandbox`` bound as their ``spec`` (None: unbound,
    for their schemas only)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if sandbox is not None:
            tool = tool.bound(sandbox)
        if tool.name in tools:
            raise ConfigError(f"rollout.multi_turn.tools: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def call_tool(tools: Mapping[str, Tool], name: str, arguments: Any) -> ToolResult:
    """Run the call ``name(**arguments)``; an unknown tool, bad arguments, a raise or a non-string
    result give an error result whose text starts with ``Error:``."""
    t0 = time.perf_counter()
    tool = tools.get(name)
    error: str | None
    if tool is None:
        error = f"unknown tool {name!r}; available: {', '.join(sorted(tools)) or 'none'}"
    else:
        error = check_arguments(tool.parameters, arguments)
    if error is None and tool is not None:
        try:
            out = tool.fn(**arguments)
            if not isinstance(out, str):
                raise TypeError(f"tool returned {type(out).__name__}, expected str")
            return ToolResult(out, None, time.perf_counter() - t0)
        except Exception as e:  # a tool never fails the rollout: the model reads the error
            error = f"{type(e).__name__}: {e}"
    assert error is not None
    return ToolResult(f"Error: {error}", error, time.perf_counter() - t0)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def check_arguments(parameters: Mapping[str, Any], arguments: Any) -> str | None:
    """None when ``arguments`` fit the JSON schema ``parameters`` (required, known names, types of
    the declared properties), else what is wrong."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props: Mapping[str, Any] = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(props) or 'none'}"
    for key, value in arguments.items():
        declared = props[key].get("type") if isinstance(props[key], Mapping) else None
        kinds = [declared] if isinstance(declared, str) else list(declared or [])
        types = tuple(t for k in kinds for t in _JSON_TYPES.get(k, (object,)))
        is_bool_as_number = isinstance(value, bool) and "boolean" not in kinds
        if types and (not isinstance(value, types) or is_bool_as_number):
            return f"argument {key!r} must be of type {' or '.join(kinds)}, got {type(value).__name__}"
    return None


def _check_schema(parameters: Any, where: str) -> None:
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise ConfigError(f"tool {where!r}: 'parameters' must be a JSON schema with type 'object'")
