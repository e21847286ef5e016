"""The ``calculator`` tool: safe arithmetic on an expression string, parsed with :mod:`ast`, no ``eval``.

Allowed: int and float literals, ``+ - * / // % **``, unary ``-`` / ``+`` and parentheses. Anything
else (names, calls, attribute access, subscripts, strings, comparisons ...) is rejected before any
arithmetic runs. Sizes are bounded so that no expression can stall the rollout: at most
``MAX_CHARS`` characters, integers of at most ``MAX_BITS`` bits (a power is refused *before* it is
computed when its result would be larger), no complex results.

Results: integers exactly (``2 ** 10`` → ``1024``), floats with 12 significant digits and no trailing
zeros (``7 / 2`` → ``3.5``, ``6 / 3`` → ``2``). Errors raise :class:`CalculatorError`; as a tool the
registry turns them into the ``Error: ...`` text the model reads.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from verl_core.tools.registry import Tool, register_tool

MAX_CHARS = 256
MAX_BITS = 4096  # ~1233 decimal digits

Number = int | float


class CalculatorError(ValueError):
    """The expression is not allowed arithmetic, or its value is too large / undefined."""


_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of the arithmetic ``expression`` as text (see module docstring)."""
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(
            f"not an arithmetic expression ({e.msg if isinstance(e, SyntaxError) else e})"
        ) from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result too large") from None
    return _format(value)


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalculatorError(
        f"{type(node).__name__} is not allowed (only numbers, + - * / // % ** and parentheses)"
    )


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse ``base ** exponent`` before computing it when the result would exceed MAX_BITS."""
    if abs(base) <= 1:
        return
    # log2 |base ** exponent| = exponent · log2 |base|
    if exponent * math.log2(abs(base)) > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")


def _checked(value: object) -> Number:
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    assert isinstance(value, int | float)
    return value


def _format(value: Number) -> str:
    if isinstance(value, int):
        return str(value)
    return format(value, ".12g")


CALCULATOR = register_tool(
    Tool(
        name="calculator",
        description="Evaluate an arithmetic expression with numbers, + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 123 * (45 - 6)"}},
            "required": ["expression"],
        },
        fn=calculate,
    )
)
