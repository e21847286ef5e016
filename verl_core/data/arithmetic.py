"""Synthetic multi-step arithmetic in the GSM8K format: a deterministic, seeded generator.

It exists so that the CPU quickstart (a ~1M-parameter model trained from scratch) can show learning
under RL within minutes: the worked solutions are short (one line per step, then ``#### N``), yet
multi-step sums of 2-digit operands with carries are hard enough that a tiny model does not solve
them all after SFT alone. Example (digits=2, steps=2, ops=+-)::

    question: "Start with 37. Add 48, then subtract 25. What is the result?"
    solution: "37 + 48 = 85\\n85 - 25 = 60\\n#### 60"

Operations are applied left to right (no precedence), results never go negative (a subtraction
draws an operand no larger than the running value), and the operand of ``*`` has one digit so that
numbers stay short.

An incomplete teacher (``stop_early`` > 0): with that probability a training demonstration stops
one operation short, reporting the value before the last operation as the answer (``#### 85``
for "Start with 37. Add 48, then subtract 25."); the lines it does show are correct. The problem
and its ``answer`` stay exact. SFT imitates the habit, and RL with the exact-answer reward has to
learn to carry the computation through to the end: the quickstart's demonstration that RL improves
on its SFT data (the held-out solutions are always complete).

A teacher of two styles (``terse_share`` > 0): with that probability a training demonstration gives
the exact answer at once (``#### 60``), otherwise the worked solution; both are correct (held-out
demonstrations follow the same mix), but a model too small to carry several operations in its head is
right far less often the terse way than the worked way. SFT imitates the mix of styles (greedy decoding
follows the more frequent one), and RL with the exact-answer reward has to turn the samples that work
the problem out (pass@k) into the model's first choice (pass@1): the sharpening demonstration,
``configs/quickstart_sharpen.yaml``.

A tool-using teacher (``tool_share`` > 0, :func:`tool_demonstration`): with that probability a
training demonstration calls the ``calculator`` tool in the Hermes format and copies its result;
otherwise it answers at once, ``#### N`` with the exact N, which a model too small to multiply
three-digit numbers in its head cannot imitate. As a chat (the earlier turns of a multi-turn SFT row,
then the final answer)::

    assistant: <tool_call>
               {"name": "calculator", "arguments": {"expression": "(347 * 8) + 512"}}
               </tool_call>
    tool:      3288
    answer:    #### 3288
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from verl_core.seeding import derive_seed

_VERBS = {"+": "add {b}", "-": "subtract {b}", "*": "multiply by {b}"}
_OPENINGS = ("Start with {a}.", "Begin with {a}.", "Take {a}.")
_QUESTIONS = ("What is the result?", "What number do you get?", "What is the final number?")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One generated problem: ``question`` text, worked ``solution`` ending in ``#### answer``."""

    question: str
    solution: str
    answer: int


def make_problem(rng: random.Random, digits: int, steps: int, ops: Sequence[str]) -> ArithmeticProblem:
    """One problem with ``steps`` operations drawn from ``ops`` on ``digits``-digit operands."""
    hi = 10**digits - 1
    lo = 10 ** (digits - 1) if digits > 1 else 0
    value = rng.randint(lo, hi)
    phrases: list[str] = []
    lines: list[str] = []
    opening = rng.choice(_OPENINGS).format(a=value)
    for _ in range(steps):
        op = rng.choice(list(ops))
        if op == "*":
            b = rng.randint(2, 9)
            new = value * b
        elif op == "-":
            b = rng.randint(min(lo, value), min(hi, value))  # never below zero
            new = value - b
        else:
            b = rng.randint(lo, hi)
            new = value + b
        phrases.append(_VERBS[op].format(b=b))
        lines.append(f"{value} {op} {b} = {new}")
        value = new
    body = ", then ".join(phrases)
    question = f"{opening} {body[0].upper()}{body[1:]}. {rng.choice(_QUESTIONS)}"
    solution = "\n".join([*lines, f"#### {value}"])
    return ArithmeticProblem(question=question, solution=solution, answer=value)


def teacher_solution(
    problem: ArithmeticProblem, stop_early: float, rng: random.Random, *, terse_share: float = 0.0
) -> str:
    """The demonstration of a teacher: with probability ``terse_share`` the exact answer at once,
    ``#### N`` (a teacher of two styles, both correct); else, with probability ``stop_early``
    (problems of two or more operations), the worked solution with the last operation left out and
    the value before it reported (an incomplete teacher); else the exact worked solution. A share of 0
    draws nothing from ``rng`` (the other share's draws are the same with or without it)."""
    if terse_share and rng.random() < terse_share:
        return f"#### {problem.answer}"
    if not stop_early:
        return problem.solution
    lines = problem.solution.split("\n")[:-1]  # "a op b = c" per operation
    if len(lines) < 2 or rng.random() >= stop_early:
        return problem.solution
    shown = lines[:-1]
    return "\n".join([*shown, f"#### {shown[-1].rsplit(' = ', 1)[1]}"])


def calculator_expression(problem: ArithmeticProblem) -> str:
    """The problem as one expression evaluated in its left-to-right order: ``"(347 * 8) + 512"``."""
    lines = problem.solution.split("\n")[:-1]  # "a op b = c" per operation
    expression = lines[0].split(" = ")[0]
    for line in lines[1:]:
        _, op, b = line.split(" = ")[0].split(" ")
        expression = f"({expression}) {op} {b}"
    return expression


def tool_demonstration(
    problem: ArithmeticProblem, tool_share: float, rng: random.Random
) -> tuple[list[dict[str, str]], str]:
    """``(turns, answer)`` of a teacher that calls the calculator with probability ``tool_share``:
    turns = [assistant tool call, tool result] then the answer ``#### N`` copied from the result;
    otherwise no turns and ``#### N`` at once (see the module docstring). N is always exact."""
    final = f"#### {problem.answer}"
    if rng.random() >= tool_share:
        return [], final
    call = json.dumps({"name": "calculator", "arguments": {"expression": calculator_expression(problem)}})
    turns = [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": str(problem.answer)},
    ]
    return turns, final


def generate(
    num_problems: int, *, seed: int, digits: int = 2, steps: int = 2, ops: Sequence[str] = ("+", "-")
) -> Iterator[ArithmeticProblem]:
    """``num_problems`` distinct problems (distinct questions), the same for the same arguments.

    Raises ValueError when the space of problems is too small for ``num_problems`` distinct ones."""
    unknown = sorted(set(ops) - set(_VERBS))
    if unknown or not ops:
        raise ValueError(f"arithmetic ops must be a non-empty subset of {sorted(_VERBS)}, got {list(ops)}")
    rng = random.Random(derive_seed("arithmetic", seed, digits, steps, "".join(ops)))
    seen: set[str] = set()
    attempts = 0
    while len(seen) < num_problems:
        attempts += 1
        if attempts > 20 * num_problems + 1000:
            raise ValueError(
                f"cannot generate {num_problems} distinct arithmetic problems with digits={digits}, "
                f"steps={steps}, ops={list(ops)}: increase digits or steps"
            )
        problem = make_problem(rng, digits, steps, ops)
        if problem.question in seen:
            continue
        seen.add(problem.question)
        yield problem
