"""The tool registry: built-ins by name, user tools from module:function with a schema, argument checks."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest

from verl_core.errors import ConfigError
from verl_core.tools import TOOLS, Tool, call_tool, load_tool, load_tools, register_tool, tool_schema

SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a key up",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string"}, "times": {"type": "integer"}},
            "required": ["key"],
        },
    },
}


@pytest.fixture
def user_module() -> Iterator[str]:
    mod = types.ModuleType("mt_user_tools")

    @tool_schema(SCHEMA)
    def lookup(key: str, times: int = 1) -> str:
        return key * times

    def no_schema(key: str) -> str:
        return key

    def boom() -> str:
        raise RuntimeError("kaput")

    boom.schema = {"name": "boom", "parameters": {"type": "object", "properties": {}}}  # type: ignore[attr-defined]

    def not_text() -> int:
        return 3

    not_text.schema = {"name": "not_text", "parameters": {"type": "object", "properties": {}}}  # type: ignore[attr-defined]
    mod.lookup, mod.no_schema, mod.boom, mod.not_text = lookup, no_schema, boom, not_text  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    del sys.modules[mod.__name__]


def test_builtin_by_name_and_unknown_name_lists_valid() -> None:
    assert load_tool("calculator") is TOOLS.get("calculator")
    with pytest.raises(ConfigError, match=r"Unknown tool 'calculater'.*Did you mean 'calculator'"):
        load_tool("calculater")


def test_user_tool_from_module_function(user_module: str) -> None:
    tool = load_tool(f"{user_module}:lookup")
    assert tool.name == "lookup" and tool.openai_schema() == SCHEMA
    tools = load_tools(["calculator", f"{user_module}:lookup"])
    assert sorted(tools) == ["calculator", "lookup"]
    assert call_tool(tools, "lookup", {"key": "ab", "times": 2}).text == "abab"


def test_user_tool_needs_a_schema(user_module: str) -> None:
    with pytest.raises(ConfigError, match="no 'schema' attribute"):
        load_tool(f"{user_module}:no_schema")
    with pytest.raises(ConfigError, match="cannot import module"):
        load_tool("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match="two tools are named 'lookup'"):
        load_tools([f"{user_module}:lookup", f"{user_module}:lookup"])


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({}, "missing required argument(s): key"),
        ({"key": "a", "nope": 1}, "unknown argument(s): nope; expected: key, times"),
        ({"key": 3}, "argument 'key' must be of type string, got int"),
        ({"key": "a", "times": True}, "argument 'times' must be of type integer, got bool"),
        (["a"], "arguments must be a JSON object, got list"),
    ],
)
def test_bad_arguments_are_error_text(user_module: str, arguments: object, error: str) -> None:
    tools = load_tools([f"{user_module}:lookup"])
    result = call_tool(tools, "lookup", arguments)
    assert result.error == error and result.text == f"Error: {error}"


def test_raising_or_non_text_tools_and_unknown_tool_give_error_text(user_module: str) -> None:
    tools = load_tools([f"{user_module}:boom", f"{user_module}:not_text"])
    assert call_tool(tools, "boom", {}).text == "Error: RuntimeError: kaput"
    assert call_tool(tools, "not_text", {}).text == "Error: TypeError: tool returned int, expected str"
    assert call_tool(tools, "calc", {}).text == "Error: unknown tool 'calc'; available: boom, not_text"


def test_register_builtin_once_and_schema_checked() -> None:
    tool = Tool(
        "echo_test_tool", "echo", {"type": "object", "properties": {"s": {"type": "string"}}}, lambda s: s
    )
    register_tool(tool)
    try:
        assert load_tool("echo_test_tool") is tool
        with pytest.raises(ValueError, match="already registered"):
            register_tool(tool)
    finally:
        TOOLS._entries.pop("echo_test_tool")
    with pytest.raises(ConfigError, match="type 'object'"):
        register_tool(Tool("bad_schema_tool", "", {"type": "string"}, lambda: ""))
