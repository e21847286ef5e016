"""What every config section is built from: the :class:`Section` base (unknown keys are errors,
values frozen), the field helper that pairs a default with its one-line description, and the
constrained number types. The names of algorithm variants are the ``Literal`` types of
:mod:`verl_core.algorithms`, defined next to their registries, so the config accepts exactly the
registered names."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from verl_core.algorithms import AdvEstimatorName, KLEstimatorName, PolicyLossName

# The config's names for them (kept: other code imports these from verl_core.config).
AdvEstimator = AdvEstimatorName
PolicyLoss = PolicyLossName
KLEstimator = KLEstimatorName

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegFloat = Annotated[float, Field(ge=0)]
Prob = Annotated[float, Field(ge=0, le=1)]


Strategy = Literal["single", "fsdp2", "deepspeed"]


def _f(default: Any, description: str, **kw: Any) -> Any:
    """A field with its default and its one-line description."""
    return Field(default, description=description, **kw)


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are immutable once validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
