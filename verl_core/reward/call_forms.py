"""How a custom reward function is called: its signature, inspected once, picks one of the forms below,
and the scorer calls it that way for every sample (or batch). A signature that fits none is a
:class:`~verl_core.errors.ConfigError` naming the function and the forms it could have.

``sample`` mode (one call per response), any of::

    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...)   # verl's custom reward
    fn(solution_str=..., ground_truth=...)            # verl's built-in scorers, e.g. compute_score(
                                                      #   solution_str, ground_truth, method=..., ...)
    fn(completion, ground_truth=..., data_source=..., extra_info=...)   # verl-flow's own form

``batch`` mode (one call for the whole batch; lists in, a list out), any of::

    fn(data_sources=..., solution_strs=..., ground_truths=..., extra_infos=...)   # verl's batch manager
    fn(completions, ground_truths=..., data_sources=..., extra_infos=...)          # TRL's / verl-flow's

verl's forms are recognised by a parameter named ``solution_str`` (``solution_strs``) and called by
keyword only, as verl calls them. The positional form passes the response(s) as the first positional
parameter. In either, a keyword is passed when the function names it or takes ``**kwargs``; a
parameter without a default that is none of these names does not fit. A function whose parameter
names belong to the other mode (``ground_truths`` in sample mode) is told to switch
``reward.function_mode``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, NamedTuple

from verl_core.errors import ConfigError

FunctionMode = Literal["batch", "sample"]
FUNCTION_MODES: tuple[FunctionMode, ...] = ("batch", "sample")

# Input fields (FunctionInputs order: completions, ground_truths, data_sources, extra_infos) → the
# keyword each form passes them under, per mode.
_FIELDS = ("completion", "ground_truth", "data_source", "extra_info")
_VERL_NAMES: dict[FunctionMode, tuple[str, ...]] = {
    "sample": ("solution_str", "ground_truth", "data_source", "extra_info"),
    "batch": ("solution_strs", "ground_truths", "data_sources", "extra_infos"),
}
_OWN_NAMES: dict[FunctionMode, tuple[str, ...]] = {
    "sample": ("completion", "ground_truth", "data_source", "extra_info"),
    "batch": ("completions", "ground_truths", "data_sources", "extra_infos"),
}
FORMS: dict[FunctionMode, tuple[str, ...]] = {
    "sample": (
        "fn(data_source, solution_str, ground_truth, extra_info=None) by keyword (verl's custom reward)",
        "fn(solution_str, ground_truth, ...) (verl's built-in compute_score)",
        "fn(completion, *, ground_truth, data_source, extra_info) (completion positional)",
    ),
    "batch": (
        "fn(data_sources, solution_strs, ground_truths, extra_infos) by keyword (verl's batch reward)",
        "fn(completions, *, ground_truths, data_sources, extra_infos) (completions positional)",
    ),
}


class CallForm(NamedTuple):
    """How to call one function: ``positional`` (the response(s) as first positional argument, else
    every argument by keyword) and ``keywords``: input field (``_FIELDS``) → the keyword it is passed
    as; fields not in it are not passed."""

    positional: bool
    keywords: dict[str, str]
    description: str

    def arguments(self, values: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of one call from ``values`` (field → value)."""
        args = (values["completion"],) if self.positional else ()
        return args, {kw: values[field] for field, kw in self.keywords.items()}


FILE_MODULE_PREFIX = "verl_flow_reward_file_"  # the module name of a reward function loaded by file path


def function_name(fn: Callable[..., Any]) -> str:
    """``module:qualname`` of ``fn`` (``path/file.py:qualname`` when loaded by file path; its repr when
    it has no name; a ``functools.partial``: its function's)."""
    while isinstance(fn, partial):
        fn = fn.func
    qualname = getattr(fn, "__qualname__", None)
    module = str(getattr(fn, "__module__", "?"))
    if qualname is None:
        return repr(fn)
    if module.startswith(FILE_MODULE_PREFIX):
        module = str(getattr(sys.modules.get(module), "__file__", module))
    return f"{module}:{qualname}"


def call_form(fn: Callable[..., Any], mode: FunctionMode) -> CallForm:
    """The form ``fn`` is called in under ``mode`` (see module doc); ConfigError when it fits none."""
    if mode not in FUNCTION_MODES:
        raise ConfigError(f"reward.function_mode: got {mode!r}, expected one of {', '.join(FUNCTION_MODES)}")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the positional form, all keywords
        return CallForm(True, dict(zip(_FIELDS[1:], _OWN_NAMES[mode][1:], strict=True)), "positional")
    by_keyword = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    any_keyword = any(p.kind == p.VAR_KEYWORD for p in params.values())
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star_args = any(p.kind == p.VAR_POSITIONAL for p in params.values())
    other: FunctionMode = "batch" if mode == "sample" else "sample"
    this_mode = set(_VERL_NAMES[mode]) | set(_OWN_NAMES[mode])
    other_mode = sorted(set(params) & (set(_VERL_NAMES[other]) | set(_OWN_NAMES[other])))
    if other_mode and not set(params) & this_mode:
        why = f"its parameters {other_mode} are {other} mode's: set reward.function_mode={other}"
        raise _mismatch(fn, mode, why)

    def passed(names: tuple[str, ...], skip: str | None) -> dict[str, str]:
        return {
            f: n
            for f, n in zip(_FIELDS, names, strict=True)
            if n != skip and (n in by_keyword or any_keyword)
        }

    verl = _VERL_NAMES[mode]
    if verl[0] in by_keyword or (any_keyword and not positional and not star_args):
        form = CallForm(False, passed(verl, None), "verl (by keyword)")
        given: set[str] = set(form.keywords.values())
    elif positional or star_args:
        first = positional[0].name if positional else None
        names = _OWN_NAMES[mode]
        keywords = passed(names, first)
        keywords.pop("completion", None)
        form = CallForm(True, keywords, "positional")
        given = set(keywords.values()) | ({first} if first else set())
    else:
        raise _mismatch(fn, mode, "it takes no positional parameter and no 'solution_str' keyword")
    missing = [
        n
        for n, p in params.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in given
    ]
    if missing:
        raise _mismatch(fn, mode, f"nothing is passed for its required parameter(s) {missing}")
    return form


def _mismatch(fn: Callable[..., Any], mode: FunctionMode, why: str) -> ConfigError:
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        signature = "(...)"
    forms = "; ".join(FORMS[mode])
    return ConfigError(
        f"reward.function: {function_name(fn)}{signature} does not fit reward.function_mode={mode} "
        f"({why}); expected one of: {forms}"
    )
