"""Tool calls in generated text, in the Hermes / Qwen2.5 format of the ``hermes`` chat template::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

:func:`parse_tool_calls` finds every ``<tool_call>...</tool_call>`` block of a model turn. A block whose
body is not a JSON object with a string ``name`` and an object ``arguments`` (a JSON string holding an
object is accepted too, as some models write it), or a ``<tool_call>`` left open, is a *malformed*
call: the loop answers it with the error text instead of running a tool, and counts it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from verl_core.registry import Registry

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


class ToolCall(NamedTuple):
    """One call found in a turn: ``error`` is None for a well-formed call (then ``name`` and
    ``arguments`` are set), else why it is malformed (``raw`` holds the block's text)."""

    name: str
    arguments: dict[str, Any]
    raw: str
    error: str | None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool-call block of ``text`` in order, malformed ones included (see module docstring)."""
    calls = [_parse_block(m.group(1)) for m in _BLOCK.finditer(text)]
    tail = text[text.rfind(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE) :] if calls else text
    if TOOL_CALL_OPEN in tail:
        raw = tail[tail.find(TOOL_CALL_OPEN) :]
        calls.append(
            ToolCall("", {}, raw, f"unterminated tool call: no {TOOL_CALL_CLOSE} after {TOOL_CALL_OPEN}")
        )
    return calls


def _parse_block(body: str) -> ToolCall:
    raw = body.strip()
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, raw, f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", {}, raw, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: reported as not an object below
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, raw, "the tool call's 'arguments' must be a JSON object")
    return ToolCall(obj["name"], arguments, raw, None)


class ToolCallFormat(NamedTuple):
    """How a model writes tool calls: ``parse`` finds them in a turn's text, ``stop`` ends a turn
    right after a call (a stop string of the engine)."""

    parse: Callable[[str], list[ToolCall]]
    stop: str


TOOL_CALL_FORMATS: Registry[ToolCallFormat] = Registry("tool-call format")
HERMES_FORMAT = TOOL_CALL_FORMATS.register("hermes")(ToolCallFormat(parse_tool_calls, TOOL_CALL_CLOSE))
