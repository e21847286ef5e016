"""Rollout engines by name: ``make_engine("hf" | "vllm" | "auto", model, tokenizer, **engine_kwargs)``
(``vllm``: a :class:`~verl_core.rollout.vllm_spec.VLLMSpec` and the vLLM environment's interpreter).

``auto`` picks per device from the figures of ``benchmarks/rollout.py`` (:data:`AUTO_ENGINE`), and
falls back to ``hf`` where vLLM is neither importable nor its environment found."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from verl_core.errors import ConfigError
from verl_core.registry import Registry, UnknownNameError
from verl_core.rollout.base import RolloutEngine
from verl_core.rollout.vllm_spec import VLLMSpec

EngineFactory = Callable[..., RolloutEngine]
ENGINES: Registry[EngineFactory] = Registry("rollout engine")


def register_engine(name: str) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator registering an engine factory ``(model, tokenizer, **kwargs) -> RolloutEngine``."""
    return ENGINES.register(name)


@register_engine("hf")
def _hf(model: str | nn.Module, tokenizer: Any, **kwargs: Any) -> RolloutEngine:
    from verl_core.rollout.hf import HFEngine

    return HFEngine(model, tokenizer, **kwargs)


@register_engine("vllm")
def _vllm(
    model: str | nn.Module,
    tokenizer: Any,
    *,
    spec: VLLMSpec,
    vllm_python: str,
    env: Mapping[str, str] | None = None,
) -> RolloutEngine:
    """vLLM built as ``spec`` says: in this process where it imports (its own environment, a GPU
    worker image), else in a subprocess of the vLLM environment (``vllm_python``,
    :mod:`verl_core.rollout.vllm_process`). ``env``: environment variables of the engine alone (its
    devices or cores): it then always runs in a subprocess (this interpreter's where vllm imports
    here), whose environment they join."""
    from verl_core.rollout.vllm import VLLMEngine, vllm_available

    if vllm_available() and not env:
        return VLLMEngine(model, tokenizer, spec)
    from verl_core.rollout.vllm_process import VLLMProcessEngine, resolve_vllm_python

    python = sys.executable if vllm_available() else resolve_vllm_python(vllm_python)
    return VLLMProcessEngine(model, tokenizer, spec, python=python, env=env)


# rollout.name=auto, per device type: the faster engine in benchmarks/rollout.py (--engines hf,vllm;
# figures in benchmarks/RESULTS.md). cpu: hf, faster than vLLM's CPU backend at the shapes measured.
# cuda: vllm, what verl, OpenRLHF and TRL roll out with on GPUs.
AUTO_ENGINE = {"cpu": "hf", "cuda": "vllm"}
log = logging.getLogger(__name__)


def _vllm_ready(vllm_python: str) -> bool:
    from verl_core.errors import ConfigError
    from verl_core.rollout.vllm import vllm_available
    from verl_core.rollout.vllm_process import resolve_vllm_python

    if vllm_available():
        return True
    try:
        resolve_vllm_python(vllm_python)
    except ConfigError:
        return False
    return True


@register_engine("auto")
def _auto(
    model: str | nn.Module,
    tokenizer: Any,
    *,
    hf: dict[str, Any],
    vllm: dict[str, Any],
    env: Mapping[str, str] | None = None,
) -> RolloutEngine:
    """:data:`AUTO_ENGINE`'s engine for the model's device (a path: cuda when visible), built with its
    own keyword arguments (``hf`` or ``vllm``); hf where vLLM is not available. ``env``: the vLLM
    engine's own environment variables (see the ``vllm`` factory); the hf engine has no process."""
    if isinstance(model, nn.Module):
        device = next(model.parameters()).device.type
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    name = AUTO_ENGINE.get(device, "hf")
    if name == "vllm" and not _vllm_ready(str(vllm["vllm_python"])):
        log.info("rollout.name=auto: vLLM is not available here (make .venv-vllm): the hf engine")
        name = "hf"
    log.info("rollout.name=auto on %s: the %s engine (verl_core.rollout.registry.AUTO_ENGINE)", device, name)
    if name == "vllm":
        return make_engine(name, model, tokenizer, **vllm, env=env)
    return make_engine(name, model, tokenizer, **hf)


def make_engine(name: str, model: str | nn.Module, tokenizer: Any = None, **kwargs: Any) -> RolloutEngine:
    """The engine registered as ``name``, built from ``model`` (path / hub id or live module)."""
    try:
        factory = ENGINES.get(name)
    except UnknownNameError as e:
        raise ConfigError(f"rollout.name: {e}") from None
    return factory(model, tokenizer, **kwargs)
