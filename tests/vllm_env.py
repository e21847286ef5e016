"""The vLLM environment for pipeline-side tests that start a vLLM engine or server in it.

``make test`` builds ``.venv-vllm`` and sets ``VERL_FLOW_REQUIRE_VLLM=1``: a missing environment is a
failure there, and a skip (saying how to build it) elsewhere."""

from __future__ import annotations

import os

import pytest

from verl_core.errors import ConfigError
from verl_core.rollout.vllm_process import resolve_vllm_python


def vllm_python() -> str:
    """The vLLM environment's interpreter, or fail (``VERL_FLOW_REQUIRE_VLLM=1``) / skip."""
    try:
        return resolve_vllm_python("auto")
    except ConfigError as e:
        if os.environ.get("VERL_FLOW_REQUIRE_VLLM") == "1":
            pytest.fail(f"VERL_FLOW_REQUIRE_VLLM=1 but {e}", pytrace=False)
        pytest.skip(f"no vLLM environment (make .venv-vllm): {e}")
