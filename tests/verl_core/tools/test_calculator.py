"""calculator: hand-worked values, and everything that is not plain arithmetic refused before it runs."""

from __future__ import annotations

import time

import pytest

from verl_core.tools import TOOLS, call_tool
from verl_core.tools.calculator import CalculatorError, calculate


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3 * 4", "14"),  # precedence: 3*4 = 12, + 2
        ("(2 + 3) * 4", "20"),
        ("123 * 456", "56088"),  # 123*456 = 49200 + 6840 + 48
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),  # float 2.0 printed without trailing zeros
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),  # floor division rounds down
        ("-7 % 3", "2"),  # Python's modulo takes the divisor's sign: -7 = 3·(-3) + 2
        ("-3 ** 2", "-9"),  # ** binds tighter than unary minus
        ("(-3) ** 2", "9"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("0.1 + 0.2", "0.3"),  # 12 significant digits
        ("+5 - -5", "10"),
        (" 1e3 ", "1000"),
    ],
)
def test_values(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "Name is not allowed"),
        ("abs(-1)", "Call is not allowed"),
        ("__import__('os').system('true')", "Call is not allowed"),
        ("(1).real", "Attribute is not allowed"),
        ("[1, 2][0]", "not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 < 2", "Compare is not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("1; 2", "not an arithmetic expression"),
        ("2 +", "not an arithmetic expression"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1" * 300, "longer than"),
    ],
)
def test_rejected(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message):
        calculate(expression)


@pytest.mark.parametrize(
    "expression", ["9 ** 9 ** 9", "10 ** 10 ** 10", "2 ** 5000", "1.5 ** 100000", "1e308 * 10"]
)
def test_huge_results_refused_fast(expression: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(CalculatorError, match="too large"):
        calculate(expression)
    assert time.perf_counter() - t0 < 0.5  # refused before computing, not after


def test_as_a_tool_errors_become_text() -> None:
    tools = {"calculator": TOOLS.get("calculator")}
    ok = call_tool(tools, "calculator", {"expression": "12 * 34"})
    assert (ok.text, ok.error) == ("408", None)
    bad = call_tool(tools, "calculator", {"expression": "x"})
    assert bad.text.startswith("Error: CalculatorError: Name is not allowed") and bad.error is not None
