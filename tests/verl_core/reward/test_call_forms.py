"""Custom reward functions written in each form a user brings: verl's custom ``compute_score`` (by
keyword), verl's built-in scorer signature, verl's batch form, verl-flow's positional forms; loaded by
module path or by file path; dict returns; what does not fit; error kinds and what they mean for
``score_rollouts`` and the preflight probe (verl_core.reward.call_forms, .functions, .probe)."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_core.errors import ConfigError
from verl_core.reward import (
    FunctionInputs,
    FunctionScorer,
    RewardBatch,
    RewardError,
    ScorerCodeError,
    WeightedScorer,
    call_form,
    load_reward_function,
    run_reward_function,
    score_rollouts,
)
from verl_core.reward.probe import probe_reward_function

# Written for these tests in the styles users bring (signatures as verl documents them).
USER_FILE = '''
import re

def verl_custom(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom reward signature: called by keyword."""
    found = re.findall(r"#### (-?[0-9]+)", solution_str)
    return 1.0 if found and found[-1] == ground_truth else 0.0

def verl_custom_kwargs(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(len(kwargs) == 0 and extra_info["sample_index"] == 1)

def verl_builtin(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """verl's built-in scorer signature: no data_source, options with defaults."""
    if "####" not in solution_str:
        return 0
    return score if solution_str.split("####")[-1].strip() == ground_truth else format_score

def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str.endswith(ground_truth)
    return {"score": 2.0 if right else 0.0, "acc": right, "pred": solution_str[-1:]}

def verl_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [float(s.endswith(g)) for s, g in zip(solution_strs, ground_truths)]

def own_sample(completion, *, ground_truth, data_source, extra_info):
    return float(completion.endswith(ground_truth)) + (10.0 if data_source == "b" else 0.0)

def own_batch(completions, *, ground_truths, data_sources, extra_infos):
    return [float(len(c)) for c in completions]

def only_kwargs(**kwargs):
    return float(sorted(kwargs) == ["data_source", "extra_info", "ground_truth", "solution_str"])

def unfit(text, reference):
    return 1.0

def type_error(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) + None

def key_error(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth != "1":
        return extra_info["no_such_key"]
    return 1.0

def runtime_error(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("the grader's service is down")

def verl_weighted(data_source, solution_str, ground_truth, extra_info=None, *, weight, bonus=0.0):
    """A verl function with custom_reward_function.reward_kwargs: weight is required."""
    return weight * float(solution_str.endswith(ground_truth)) + bonus

def verl_batch_weighted(data_sources, solution_strs, ground_truths, extra_infos, weight):
    return [weight * float(s.endswith(g)) for s, g in zip(solution_strs, ground_truths)]
'''


@pytest.fixture
def user_file(tmp_path: Path) -> Iterator[Path]:
    """The functions above in a file that is not importable as a module (not on sys.path)."""
    path = tmp_path / "my reward-fns.py"  # a name no import statement could spell
    path.write_text(textwrap.dedent(USER_FILE))
    before = set(sys.modules)
    yield path
    for name in set(sys.modules) - before:
        sys.modules.pop(name, None)


def inputs(completions: list[str], truths: list[str], sources: list[str] | None = None) -> FunctionInputs:
    n = len(completions)
    return FunctionInputs(completions, truths, sources or ["a"] * n, [{"sample_index": i} for i in range(n)])


def batch(completions: list[str], truths: list[str]) -> RewardBatch:
    n = len(completions)
    return RewardBatch(
        list(range(n)), [0] * n, ["openai/gsm8k"] * n, truths, ["q"] * n, completions, [3] * n,
        ["stop"] * n, [{"sample_index": i} for i in range(n)],
    )  # fmt: skip


def test_verl_signatures_work_as_written(user_file: Path) -> None:
    rows = inputs(["x #### 7", "x #### 8", "no answer"], ["7", "7", "7"])
    custom = load_reward_function(f"{user_file}:verl_custom")
    assert call_form(custom, "sample").positional is False  # by keyword, as verl calls it
    # before: compute_score() got multiple values for argument 'data_source' on every sample
    assert run_reward_function(custom, rows, mode="sample", timeout_s=10).scores == [1.0, 0.0, 0.0]
    builtin = load_reward_function(f"{user_file}:verl_builtin")
    out = run_reward_function(builtin, rows, mode="sample", timeout_s=10)
    assert out.scores == [1.0, 0.0, 0.0] and out.errors == [None] * 3  # its defaults: score 1, format 0
    extra = load_reward_function(f"{user_file}:verl_custom_kwargs")  # **kwargs: nothing extra passed
    assert run_reward_function(extra, rows, mode="sample", timeout_s=10).scores == [0.0, 1.0, 0.0]
    only = load_reward_function(f"{user_file}:only_kwargs")  # **kwargs alone: verl's four keywords
    assert run_reward_function(only, rows, mode="sample", timeout_s=10).scores == [1.0] * 3


def test_verl_batch_form_gets_the_plural_keywords(user_file: Path) -> None:
    fn = load_reward_function(f"{user_file}:verl_batch")
    out = run_reward_function(fn, inputs(["a 7", "a 8"], ["7", "7"]), mode="batch", timeout_s=10)
    assert out.scores == [1.0, 0.0] and out.errors == [None, None]  # before: no argument 'ground_truths'


def test_own_forms_keep_working(user_file: Path) -> None:
    sample = load_reward_function(f"{user_file}:own_sample")
    out = run_reward_function(
        sample, inputs(["is 7", "is 7"], ["7", "8"], ["a", "b"]), mode="sample", timeout_s=10
    )
    assert out.scores == [1.0, 10.0]  # ends with "7": 1; data_source "b": +10
    own = load_reward_function(f"{user_file}:own_batch")
    assert run_reward_function(own, inputs(["ab", ""], ["1", "1"]), mode="batch", timeout_s=10).scores == [
        2.0,
        0.0,
    ]


def test_a_dict_return_gives_its_score_and_numeric_extras_as_metrics(user_file: Path) -> None:
    scorer = FunctionScorer(load_reward_function(f"{user_file}:verl_dict"), "sample", 10)
    out = scorer(batch(["is 7", "is 8", "is 7"], ["7", "7", "7"]))
    assert out.scores == [2.0, 0.0, 2.0] and out.errors == [None] * 3
    # "acc" (bool) is averaged: 2 of 3; "pred" (text) has no per-sample place: dropped
    assert out.metrics == {"extra/acc": pytest.approx(2 / 3)}


def test_a_file_path_loads_relative_to_the_working_directory_once(
    user_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(user_file.parent)
    relative = load_reward_function(f"{user_file.name}:verl_custom")
    absolute = load_reward_function(f"{user_file}:verl_custom")
    assert relative is absolute  # one module per file and process
    assert os.path.basename(relative.__code__.co_filename) == user_file.name


def test_signatures_that_fit_no_form_name_the_function_and_the_forms(user_file: Path) -> None:
    with pytest.raises(ConfigError) as e:
        FunctionScorer(load_reward_function(f"{user_file}:unfit"), "sample", 10)
    message = str(e.value)
    assert "unfit(text, reference)" in message and "['reference']" in message
    assert "fn(data_source, solution_str, ground_truth, extra_info=None)" in message
    assert "fn(completion, *, ground_truth, data_source, extra_info)" in message
    with pytest.raises(ConfigError, match=r"are batch mode's: set reward.function_mode=batch"):
        call_form(load_reward_function(f"{user_file}:verl_batch"), "sample")
    with pytest.raises(ConfigError, match=r"are sample mode's: set reward.function_mode=sample"):
        call_form(load_reward_function(f"{user_file}:verl_custom"), "batch")


def test_bad_specs_name_both_forms(tmp_path: Path) -> None:
    both = r"'package\.module:function' or 'path/to/file\.py:function'"
    with pytest.raises(ConfigError, match=both):
        load_reward_function("no_colon_here")
    with pytest.raises(ConfigError, match=rf"no file .*nothere\.py .*{both}"):
        load_reward_function(f"{tmp_path}/nothere.py:f")
    with pytest.raises(ConfigError, match=r"cannot import module 'nosuchmod_xyz'.*PYTHONPATH.*file\.py:f"):
        load_reward_function("nosuchmod_xyz:f")
    broken = tmp_path / "broken.py"
    broken.write_text("import nosuchmod_xyz\n")
    with pytest.raises(ConfigError, match=r"loading .*broken\.py failed \(ModuleNotFoundError"):
        load_reward_function(f"{broken}:f")


def test_error_kinds_decide_what_score_rollouts_raises(user_file: Path) -> None:
    rows = batch(["#### 1", "#### 2"], ["1", "2"])

    def score(name: str) -> None:
        scorer = FunctionScorer(load_reward_function(f"{user_file}:{name}"), "sample", 10)
        score_rollouts(
            rows, [WeightedScorer("function", 1.0, scorer)], on_error="fail", max_response_length=8
        )

    with pytest.raises(ScorerCodeError, match=r"TypeError"):  # raised on any input: no retry can help
        score("type_error")
    with pytest.raises(ScorerCodeError, match=r"KeyError"):  # raised again on the same row
        score("key_error")
    with pytest.raises(RewardError, match=r"service is down") as e:  # may pass on a retry
        score("runtime_error")
    assert not isinstance(e.value, ScorerCodeError)


def test_probe_refuses_broken_code_and_warns_on_row_dependent_failures(user_file: Path) -> None:
    assert probe_reward_function(f"{user_file}:verl_custom", "sample", timeout_s=10) is None
    with pytest.raises(ConfigError, match=r"failed on a synthetic row .*TypeError"):
        probe_reward_function(f"{user_file}:type_error", "sample", timeout_s=10)
    with pytest.raises(ConfigError, match=r"cannot import module 'nosuchmod'"):
        probe_reward_function("nosuchmod:f", "sample", timeout_s=10)
    # the synthetic row's ground truth is "1": key_error scores it; runtime_error may be transient
    assert probe_reward_function(f"{user_file}:key_error", "sample", timeout_s=10) is None
    warning = probe_reward_function(f"{user_file}:runtime_error", "sample", timeout_s=10)
    assert warning is not None and "RuntimeError: the grader's service is down" in warning


def test_function_kwargs_are_passed_to_every_call_as_verl_s_reward_kwargs(user_file: Path) -> None:
    # reward.function_kwargs (verl's custom_reward_function.reward_kwargs) bound to every call:
    # weight 3, bonus 0.5 → right answer 3·1 + 0.5 = 3.5, wrong 0 + 0.5 = 0.5
    fn = load_reward_function(f"{user_file}:verl_weighted")
    scorer = FunctionScorer(fn, "sample", 10.0, {"weight": 3.0, "bonus": 0.5})
    assert scorer(batch(["#### 7", "#### 8"], ["7", "7"])).scores == [3.5, 0.5]
    # batch mode: weight 2 → [2, 0]
    fn_b = load_reward_function(f"{user_file}:verl_batch_weighted")
    assert FunctionScorer(fn_b, "batch", 10.0, {"weight": 2.0})(batch(["a 7", "a 8"], ["7", "7"])).scores == [
        2.0,
        0.0,
    ]
    # without them the required 'weight' gets nothing: refused naming the function, before any call
    with pytest.raises(ConfigError, match=r"verl_weighted.*required parameter\(s\) \['weight'\]"):
        FunctionScorer(fn, "sample", 10.0)
    # a keyword the scorer passes itself (one value per sample) cannot be fixed for every call
    with pytest.raises(ConfigError, match=r"reward.function_kwargs: ground_truth are passed by the scorer"):
        FunctionScorer(fn, "sample", 10.0, {"weight": 1.0, "ground_truth": "7"})
    # the preflight probe calls it with them too (synthetic row: response ends in its truth "1": 3.0)
    assert (
        probe_reward_function(f"{user_file}:verl_weighted", "sample", timeout_s=10, kwargs={"weight": 3.0})
        is None
    )
