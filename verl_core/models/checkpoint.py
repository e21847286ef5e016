"""Model and trainer-state files as bytes, so stages can put them in the artifact store.

Weights are safetensors in the HF layout (``save_pretrained``); a LoRA model saves its adapter only.
Trainer state (optimizer, scheduler, RNG) goes through ``torch.save`` and is read back with
``torch.load(weights_only=True)``: never an unrestricted unpickler.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.errors import ArtifactCorruptError
from verl_core.files import read_files


def model_files(
    model: nn.Module, tokenizer: Any | None = None, *, state_dict: Mapping[str, Tensor] | None = None
) -> dict[str, bytes]:
    """``save_pretrained`` of the model (and tokenizer) as ``{file name: bytes}`` (safetensors).
    ``state_dict``: the weights to write instead of the module's own (the full weights of a sharded
    module, gathered by its strategy)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # training keeps use_cache off (packed forwards need it off); a saved model is for generation too,
    # where the KV cache is much faster, so the file says on (our loaders turn it off again)
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    with tempfile.TemporaryDirectory() as tmp:
        if config is not None:
            config.use_cache = True
        try:
            extra = {} if state_dict is None else {"state_dict": dict(state_dict)}
            model.save_pretrained(tmp, safe_serialization=True, **extra)  # type: ignore[operator]
        finally:
            if config is not None:
                config.use_cache = use_cache
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        return read_files(tmp)


def state_bytes(state: Mapping[str, Any]) -> bytes:
    """Serialise trainer state (tensors, numbers, strings, nested dicts/lists)."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def load_state_bytes(data: bytes, where: str) -> dict[str, Any]:
    """Inverse of :func:`state_bytes` through the restricted (weights-only) unpickler."""
    try:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:
        raise ArtifactCorruptError(
            f"{where}: not a loadable trainer state ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(state, dict):
        raise ArtifactCorruptError(f"{where}: trainer state is a {type(state).__name__}, expected a dict")
    return state


def rng_state() -> dict[str, Any]:
    """torch (CPU, and CUDA when present) and Python RNG states."""
    import random

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    state["python_version"] = random.getstate()[0]
    state["python_gauss"] = random.getstate()[2]
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
