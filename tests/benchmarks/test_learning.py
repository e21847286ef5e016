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
