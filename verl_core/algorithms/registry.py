"""The registry of algorithm variants: :class:`verl_core.registry.Registry`, importable from here too."""

from verl_core.registry import Registry, UnknownNameError

__all__ = ["Registry", "UnknownNameError"]
