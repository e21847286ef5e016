"""No silent short runs: a training loop records the steps it planned and the steps it completed, and
ending short of the plan without an explicit reason is an error, never a quiet success.

verl users have shipped under-trained models from runs that exited 0 after fewer steps than asked (a
resumed run, a data loader that ran out). Here the SFT stage and the RL loop each report a
:class:`StepCount`; :func:`check_completed` fails the stage (and the pipeline, which records both in
its result) when ``completed < planned`` and no stop was requested. A plan smaller than the request is
fine when the count says why (``cap``: e.g. ``trainer.total_epochs`` passes over the prompts).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from verl_core.errors import VerlFlowError


class ShortRunError(VerlFlowError):
    """A training loop completed fewer steps than it planned, with no stop requested."""


class StepCount(BaseModel):
    """Planned vs completed steps of one training loop."""

    model_config = ConfigDict(frozen=True)

    unit: str = Field(description="what is counted, e.g. 'RL iterations', 'SFT optimizer steps'")
    requested: int = Field(description="what the config asks for")
    planned: int = Field(description="what the run set out to do: the request, or less for `cap`")
    completed: int = Field(description="steps done (those of earlier, resumed attempts included)")
    cap: str | None = Field(None, description="why planned < requested, e.g. the trainer.total_epochs cap")
    stop: str | None = Field(None, description="an explicit stop request that ended the loop early")

    @property
    def short(self) -> bool:
        """Fewer steps than planned without a stop request."""
        return self.completed < self.planned and self.stop is None


def check_completed(where: str, count: StepCount) -> StepCount:
    """Return ``count``; raise :class:`ShortRunError` naming planned vs completed when it is short."""
    if count.short:
        cap = f", capped from {count.requested} by {count.cap}" if count.cap else ""
        raise ShortRunError(
            f"{where}: completed {count.completed} of {count.planned} planned {count.unit}{cap}, and no "
            f"stop was requested: {count.planned - count.completed} missing (the data ran out, or a "
            "resumed run lost track); refusing to report an under-trained model as a success"
        )
    return count
