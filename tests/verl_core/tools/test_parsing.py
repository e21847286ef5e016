"""Tool calls parsed from generated text (Hermes / Qwen2.5 format), malformed ones reported."""

from __future__ import annotations

from verl_core.tools.parsing import ToolCall, parse_tool_calls

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'


def test_one_call_and_text_around_it() -> None:
    assert parse_tool_calls(f"Let me compute.\n{CALL}") == [
        ToolCall("calculator", {"expression": "12 * 34"}, CALL[12:-13], None)
    ]
    assert parse_tool_calls("The answer is 408.") == []


def test_several_calls_and_arguments_as_json_string() -> None:
    two = (
        CALL + '\n<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    )
    calls = parse_tool_calls(two)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "12 * 34"}, None),
        ("calculator", {"expression": "1+1"}, None),
    ]


def test_malformed_calls_are_reported_not_dropped() -> None:
    text = (
        "<tool_call>{name: calculator}</tool_call>"  # not JSON
        '<tool_call>["calculator"]</tool_call>'  # not an object
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'  # arguments not an object
        '<tool_call>{"name": "calc'  # left open (e.g. the turn hit its token budget)
    )
    errors = [c.error for c in parse_tool_calls(text)]
    assert len(errors) == 4
    assert errors[0] is not None and errors[0].startswith("the tool call is not valid JSON")
    assert errors[1] == 'the tool call must be a JSON object {"name": ..., "arguments": {...}}'
    assert errors[2] == "the tool call's 'arguments' must be a JSON object"
    assert errors[3] == "unterminated tool call: no </tool_call> after <tool_call>"
