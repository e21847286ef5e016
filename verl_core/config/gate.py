"""The ``gate`` section: the champion/challenger gate after eval (:mod:`verl_core.algorithms.paired`
holds the statistics, ``stages/gate.py`` the stage). Off by default; the ``nightly-retrain``
deployment turns it on."""

from __future__ import annotations

from verl_core.config.base import PositiveInt, Prob, Section, _f


class GateConfig(Section):
    enable: bool = _f(
        False,
        "Compare the exported policy with the registry's champion after eval and promote it on a pass "
        "(needs export.register_model and an MLflow tracking URI)",
    )
    confidence: float = _f(
        0.95,
        "Confidence of the paired tests: McNemar p must be < 1 - this, and the difference's bootstrap "
        "interval is at this level (0: the point estimates decide)",
        ge=0,
        lt=1,
    )
    min_improvement: float = _f(
        0.0, "Accuracy gain the low end of the difference's interval must reach to promote", ge=-1, le=1
    )
    max_regression: Prob = _f(
        0.05, "Largest accuracy drop allowed on any one data source (challenger - champion >= -this)"
    )
    min_accuracy: Prob = _f(0.0, "Accuracy the first model (no champion yet) must reach to become champion")
    require_promotion: bool = _f(
        False, "End the flow run Failed with the decision when the gate rejects the challenger (CI)"
    )
    n_resamples: PositiveInt = _f(10_000, "Bootstrap resamples of the accuracy difference's interval")
    seed: int = _f(0, "Seed of the bootstrap resamples")
