"""The library warnings a CPU flow run would log are dropped at their loggers, one message each, and
nothing else of those loggers is (:mod:`flows.quiet`)."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import flows  # noqa: F401  (installs the filters, as a flow run's import of its entrypoint does)
from flows.quiet import NOISE

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(NOISE))
def test_only_the_named_message_is_dropped(name: str, caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger(name)
    propagate = logger.propagate
    logger.propagate = True  # DeepSpeed's logger does not propagate: caplog listens at the root
    try:
        with caplog.at_level(logging.WARNING, logger=name):
            logger.warning(NOISE[name] + " (details)")
            logger.warning("another warning of %s", name)
    finally:
        logger.propagate = propagate
    # as a set: after other tests in the same process a record can reach the capture twice
    # (a second capture handler on the way up); what matters is which messages got through
    assert {r.getMessage() for r in caplog.records if r.name == name} == {f"another warning of {name}"}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_deepspeed_imported_as_a_save_does_prints_no_accelerator_warning() -> None:
    """accelerate's extract_model_from_parallel (under every save_pretrained) imports DeepSpeed; on a
    machine without CUDA its probe printed "Setting accelerator to CPU ..." to stdout."""
    code = (
        "import flows, torch\n"
        "from accelerate.utils import extract_model_from_parallel\n"
        "extract_model_from_parallel(torch.nn.Linear(1, 1))\n"
        "import deepspeed.accelerator as a\n"
        "print('accelerator', a.get_accelerator()._name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    if "accelerator cpu" not in out.stdout:
        pytest.skip("DeepSpeed found an accelerator here: its CPU warning is not logged")
    assert "Setting accelerator to CPU" not in out.stdout + out.stderr
