"""Errors that carry a message meant for the user: the CLI prints them as one line, no traceback."""

from __future__ import annotations


class VerlFlowError(Exception):
    """Base of every error whose message alone tells the user what is wrong and where."""


class ConfigError(VerlFlowError, ValueError):
    """A configuration problem; the message names the field path, the value and what was expected."""


class ArtifactError(VerlFlowError):
    """An artifact is missing, corrupt or not of the expected schema; the message names the file."""


class ArtifactNotFoundError(ArtifactError, FileNotFoundError):
    """No committed manifest / file where one was expected."""


class ArtifactSchemaError(ArtifactError):
    """A table does not match the schema registered for its artifact kind."""


class ArtifactCorruptError(ArtifactError):
    """A file's bytes do not match the sha256 or size its manifest recorded."""


class DataError(VerlFlowError):
    """Input data is unusable (empty after cleaning, bad row under strict mode, unreadable file)."""


class StoreFullError(ArtifactError):
    """The store's disk (or quota) is full; nothing of the stage being written was committed."""


class StoreUnavailableError(VerlFlowError):
    """The artifact store's endpoint stayed unreachable for longer than ``store.outage_budget_s``;
    nothing half-written was committed, a rerun resumes."""
