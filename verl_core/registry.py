"""One name -> variant registry class for every family chosen by name in the config.

Advantage estimators, policy losses, KL estimators and controllers, loss aggregation modes
(:mod:`verl_core.algorithms`), rule scorers by ``data_source`` (:mod:`verl_core.reward.rules`),
rollout engines (:mod:`verl_core.rollout.registry`) and dataset adapters
(:mod:`verl_core.data.adapters`) each hold one ``Registry``. An unknown name fails with one message
format, listing every valid name and suggesting the closest one::

    Unknown advantage estimator 'grop'. Valid names: gae, grpo, ... Did you mean 'grpo'?

Example::

    ADV_ESTIMATOR_REGISTRY: Registry[AdvantageEstimator] = Registry("advantage estimator")

    @ADV_ESTIMATOR_REGISTRY.register("gae")
    def compute_gae_advantage(...): ...

    fn = ADV_ESTIMATOR_REGISTRY.get("gae")
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F")


class UnknownNameError(KeyError, ValueError):
    """Raised by :meth:`Registry.get` for a name that is not registered.

    Subclasses both ``KeyError`` (a failed lookup) and ``ValueError`` (a bad config value), so either
    ``except`` clause catches it. ``str(err)`` is the plain message (``KeyError`` would quote it).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Registry(Generic[F]):
    """Maps names to variants of one signature ``F``.

    Args:
        kind: what the registry holds, used in error messages (e.g. ``"advantage estimator"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator that registers ``fn`` under ``name`` and returns it unchanged."""

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The variant registered as ``name``.

        Raises:
            UnknownNameError: ``name`` is not registered; the message lists the valid names (sorted)
                and the closest match, if any.
        """
        if name in self._entries:
            return self._entries[name]
        valid = self.names()
        message = f"Unknown {self.kind} {name!r}. Valid names: {', '.join(valid)}."
        close = difflib.get_close_matches(name, valid, n=1)
        if close:
            message += f" Did you mean {close[0]!r}?"
        raise UnknownNameError(message)

    def names(self) -> tuple[str, ...]:
        """All registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
