"""The preflight of a custom reward function (``reward.function``), before any work: load it, fit its
signature to ``reward.function_mode`` (:func:`verl_core.reward.call_forms.call_form`) and score one
synthetic row through the real scorer (a child process with ``reward.timeout_s``).

What refuses the function (a :class:`~verl_core.errors.ConfigError`): it cannot be loaded, fits no
call form, or its code is broken whatever it is given (a ``broken`` error,
:mod:`verl_core.reward.functions`: ``TypeError``, ``ImportError``, ``NameError``, a return that is not
a score). Any other failure on the made-up row (a ``KeyError`` on an ``extra_info`` key real rows
have, a data_source it does not know, a timeout) may not happen on real rows: it is returned as a
warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_core.errors import ConfigError
from verl_core.reward.call_forms import FunctionMode
from verl_core.reward.functions import load_reward_function
from verl_core.reward.scorers import FunctionScorer
from verl_core.reward.scoring import batch_from_columns

PROBE_RESPONSE = "1 + 0 = 1\n#### 1"
PROBE_GROUND_TRUTH = "1"
PROBE_DATA_SOURCE = "openai/gsm8k"  # the data source every verl-style dispatcher knows


def probe_reward_function(
    spec: str,
    mode: FunctionMode,
    *,
    timeout_s: float,
    data_source: str = PROBE_DATA_SOURCE,
    kwargs: Mapping[str, Any] | None = None,
) -> str | None:
    """Check ``spec`` (called with the extra keyword arguments ``kwargs``) as the preflight does (module
    doc): None when it scored the synthetic row, the failure (a warning) when that may be the row's
    fault; ConfigError when the function is unusable."""
    scorer = FunctionScorer(load_reward_function(spec), mode, timeout_s, dict(kwargs or {}))
    row = batch_from_columns(
        {
            "group_id": [0], "sample_index": [0], "prompt_index": [0], "iteration": [0],
            "data_source": [data_source], "ground_truth": [PROBE_GROUND_TRUTH],
            "prompt_text": ["What is 1 + 0?"], "response_text": [PROBE_RESPONSE],
            "response_length": [len(PROBE_RESPONSE.split())], "finish_reason": ["stop"],
            "extra_info": [{"split": "train", "index": 0, "answer": PROBE_RESPONSE,
                            "question": "What is 1 + 0?"}],  # the keys verl's gsm8k rows have
        }
    )  # fmt: skip
    out = scorer(row)
    error = out.errors[0]
    if error is None:
        return None
    what = (
        f"reward.function: {spec} failed on a synthetic row (data_source {data_source!r}, "
        f"response {PROBE_RESPONSE!r}, ground truth {PROBE_GROUND_TRUTH!r}): {error}"
    )
    if out.kinds is not None and out.kinds[0] == "broken":
        raise ConfigError(what)
    return f"{what} (it may fail only on made-up rows)"
