"""Custom reward functions: loading by 'module:function', batch and sample forms, errors, timeouts."""

from __future__ import annotations

import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_core.errors import ConfigError
from verl_core.reward import FunctionInputs, load_reward_function, run_reward_function

USER_MODULE = """
import time

def batch_len(completions, *, ground_truths, data_sources, extra_infos):
    return [float(len(c)) for c in completions]

def batch_short(completions, *, ground_truths, data_sources, extra_infos):
    return [1.0]

def batch_hangs(completions, *, ground_truths, data_sources, extra_infos):
    time.sleep(60)

def sample_match(completion, *, ground_truth, data_source, extra_info):
    return 1.0 if ground_truth in completion else 0.0

def sample_info(completion, *, ground_truth, data_source, extra_info):
    return extra_info["sample_index"] + (10.0 if data_source == "b" else 0.0)

def sample_raises(completion, *, ground_truth, data_source, extra_info):
    if completion == "boom":
        raise RuntimeError("kaboom")
    return 0.5

def sample_text(completion, *, ground_truth, data_source, extra_info):
    return "high"

def sample_hangs(completion, *, ground_truth, data_source, extra_info):
    if completion == "hang":
        time.sleep(60)
    return 1.0

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user module on sys.path under a fresh name; yields the module name."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def inputs(completions: list[str], truths: list[str] | None = None) -> FunctionInputs:
    n = len(completions)
    return FunctionInputs(
        completions,
        truths or ["7"] * n,
        ["a"] * n,
        [{"sample_index": i} for i in range(n)],
    )


def test_batch_form(user_module: str) -> None:
    fn = load_reward_function(f"{user_module}:batch_len")
    out = run_reward_function(fn, inputs(["ab", "", "abcd"]), mode="batch", timeout_s=10)
    assert out.scores == [2.0, 0.0, 4.0]  # len of each completion
    assert out.errors == [None, None, None]


def test_sample_form_gets_keywords(user_module: str) -> None:
    match = load_reward_function(f"{user_module}:sample_match")
    out = run_reward_function(match, inputs(["it is 7", "it is 8"]), mode="sample", timeout_s=10)
    assert out.scores == [1.0, 0.0]
    info = load_reward_function(f"{user_module}:sample_info")
    data = inputs(["x", "y"])._replace(data_sources=["a", "b"])
    out = run_reward_function(info, data, mode="sample", timeout_s=10)
    assert out.scores == [0.0, 11.0]  # sample_index 0; sample_index 1 + 10 for data_source "b"


def test_sample_errors_are_per_sample(user_module: str) -> None:
    fn = load_reward_function(f"{user_module}:sample_raises")
    out = run_reward_function(fn, inputs(["ok", "boom", "ok"]), mode="sample", timeout_s=10)
    assert out.scores == [0.5, 0.0, 0.5]
    assert out.errors[0] is None and out.errors[2] is None
    assert out.errors[1] == "RuntimeError: kaboom"


def test_non_number_and_wrong_length_are_errors(user_module: str) -> None:
    text = load_reward_function(f"{user_module}:sample_text")
    out = run_reward_function(text, inputs(["a"]), mode="sample", timeout_s=10)
    assert out.errors[0] is not None and "expected a number" in out.errors[0]
    short = load_reward_function(f"{user_module}:batch_short")
    out = run_reward_function(short, inputs(["a", "b"]), mode="batch", timeout_s=10)
    assert out.scores == [0.0, 0.0]
    assert all(e is not None and "1 scores for 2 completions" in e for e in out.errors)


def test_hanging_sample_times_out_and_the_rest_is_scored(user_module: str) -> None:
    fn = load_reward_function(f"{user_module}:sample_hangs")
    t0 = time.perf_counter()
    out = run_reward_function(fn, inputs(["ok", "hang", "ok"]), mode="sample", timeout_s=0.3)
    assert time.perf_counter() - t0 < 10  # the 60 s sleep was cut at 0.3 s
    assert out.scores == [1.0, 0.0, 1.0]
    assert out.errors == [None, "timed out after 0.3 s", None]


def test_hanging_batch_times_out(user_module: str) -> None:
    fn = load_reward_function(f"{user_module}:batch_hangs")
    t0 = time.perf_counter()
    out = run_reward_function(fn, inputs(["a", "b"]), mode="batch", timeout_s=0.3)
    assert time.perf_counter() - t0 < 10
    assert out.errors == ["timed out after 0.3 s (batch of 2)"] * 2


def test_loading_errors(user_module: str) -> None:
    with pytest.raises(ConfigError, match=r"expected 'package.module:function'"):
        load_reward_function("no_colon_here")
    with pytest.raises(ConfigError, match=r"cannot import module 'surely_not_a_module_xyz'"):
        load_reward_function("surely_not_a_module_xyz:f")
    with pytest.raises(ConfigError, match=r"has no attribute 'missing'.*batch_len"):
        load_reward_function(f"{user_module}:missing")
    with pytest.raises(ConfigError, match=r"is a int, not a callable"):
        load_reward_function(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(ConfigError, match=r"reward.function_mode"):
        run_reward_function(len, inputs(["a"]), mode="both", timeout_s=1)  # type: ignore[arg-type]
