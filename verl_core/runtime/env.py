"""Process environment for quiet, offline, server-less runs (set before importing Prefect/MLflow)."""

from __future__ import annotations

import os

DEFAULTS = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # the ephemeral Prefect server takes 13-17 s to start on a loaded 2-core machine; default is 20 s
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_quiet_env(offline: bool = False) -> None:
    """Telemetry off everywhere, generous Prefect start-up timeout; ``offline`` also blocks hub access."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
    if offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
