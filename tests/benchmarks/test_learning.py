"""benchmarks/learning.py's variant syntax and not-hurt check (the benchmark itself is run by hand)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "learning.py"
_spec = importlib.util.spec_from_file_location("benchmarks_learning", _PATH)
assert _spec is not None and _spec.loader is not None
learning = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = learning  # dataclasses look their module up
_spec.loader.exec_module(learning)


def test_variants_split_their_overrides_only_before_a_key() -> None:
    got = learning.parse_variants(
        ["base:", "ahead:trainer.rollout_ahead=1,rollout.share_weights=false", "stop:rollout.stop=[a,b]"]
    )
    assert [(v.name, v.overrides) for v in got] == [
        ("base", ()),
        ("ahead", ("trainer.rollout_ahead=1", "rollout.share_weights=false")),
        ("stop", ("rollout.stop=[a,b]",)),  # ",b]" starts no `key=`: the list stays whole
    ]


@pytest.mark.parametrize("spec", ["base", "a b:x=1", "v:not_an_override", "x:a=1"])
def test_malformed_or_repeated_variants_are_refused(spec: str) -> None:
    with pytest.raises(SystemExit):
        learning.parse_variants(["x:", spec])


def test_not_hurt_bound_is_the_larger_of_the_margin_and_the_baseline_std() -> None:
    # baseline 0.5, 0.6, 0.7: mean 0.6, sample std 0.1 > 0.03 → bound 0.5
    ok, bound = learning.not_hurt([0.5, 0.5, 0.51], [0.5, 0.6, 0.7])
    assert ok and bound == pytest.approx(0.5)
    # baseline 0.60, 0.60, 0.61: std 0.0058 < 0.03 → bound 0.6033 − 0.03 = 0.5733; 0.57 misses it
    ok, bound = learning.not_hurt([0.57, 0.57, 0.57], [0.60, 0.60, 0.61])
    assert not ok and bound == pytest.approx(0.57333, abs=1e-4)


def _row(seed: int, sft: float, rl: float) -> object:
    return learning.VariantRow("c", seed, "grpo", sft, rl, 1.0, 60.0)


def test_sharpening_needs_the_gain_over_sft_and_over_the_control_on_every_seed() -> None:
    rows = [_row(1, 0.20, 0.45), _row(2, 0.30, 0.42)]  # RL − SFT: +0.25, +0.12 → min +0.12
    controls = [
        learning.ControlRow("c", 1, 9, 0.25, None, None),
        learning.ControlRow("c", 2, 9, 0.31, None, None),
    ]
    ok, vs_sft, vs_ctl = learning.sharpens(rows, controls, 0.10)
    # RL − control: 0.45 − 0.25 = +0.20, 0.42 − 0.31 = +0.11 → min +0.11 ≥ 0.10
    assert ok and vs_sft == pytest.approx(0.12) and vs_ctl == pytest.approx(0.11)
    controls[1] = learning.ControlRow("c", 2, 9, 0.35, None, None)  # 0.42 − 0.35 = +0.07 < 0.10
    ok, _, vs_ctl = learning.sharpens(rows, controls, 0.10)
    assert not ok and vs_ctl == pytest.approx(0.07)
    ok, _, vs_ctl = learning.sharpens(rows, controls[:1], 0.10)  # seed 2 has no control: not met
    assert not ok and vs_ctl is None


def test_the_control_gets_the_epochs_the_rl_loop_s_seconds_buy() -> None:
    # 5 epochs in 100 s (20 s each); an RL loop of 45 s buys ceil(5 · 45 / 100) = ceil(2.25) = 3 more
    assert learning.control_epochs(5, 100.0, 45.0) == 8
    assert learning.control_epochs(5, 100.0, 0.0) == 5  # no RL time, no extra SFT


def test_rl_stage_seconds_sum_the_recorded_stage_times_only(monkeypatch: pytest.MonkeyPatch) -> None:
    summaries = {
        "rollout": {0: {"seconds": 1.0}, 1: {"seconds": 2.0}},
        "reward": {0: {"seconds": 0.5}, 1: {}},
        "update": {0: {"timing_s/update_actor": 3.0, "timing_s/old_log_prob": 1.0, "actor/lr": 9.0}},
    }
    monkeypatch.setattr(
        "stages.floor.locations.iteration_summaries", lambda store, run_id, stage: summaries[stage]
    )
    # rollouts 1 + 2, reward 0.5, update phases 3 + 1 (not the lr) = 7.5
    assert learning.rl_stage_seconds(None, "run") == pytest.approx(7.5)
