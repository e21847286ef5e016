"""Model and trainer-state files as bytes, so stages can put them in the artifact store.

Weights are safetensors in the HF layout (``save_pretrained``); a LoRA model saves its adapter only.
Trainer state (optimizer, scheduler, RNG) goes through ``torch.save`` and is read back with
``torch.load(weights_only=True)``: never an unrestricted unpickler. At scale it is a file, not bytes
(:func:`save_state` / :func:`load_state`): the optimizer moments of a 0.5B critic are ~4 GB, and a
bytes copy of them beside the tensors doubled the checkpoint's peak memory.
"""

from __future__ import annotations

import io
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.errors import ArtifactCorruptError


def model_files(
    model: nn.Module, tokenizer: Any | None = None, *, state_dict: Mapping[str, Tensor] | None = None
) -> dict[str, bytes]:
    """``save_pretrained`` of the model (and tokenizer) as ``{file name: bytes}`` (safetensors).
    ``state_dict``: the weights to write instead of the module's own (the full weights of a sharded
    module, gathered by its strategy)."""
    with saved_model(model, tokenizer, state_dict=state_dict) as files:
        return {name: path.read_bytes() for name, path in files.items()}


@contextmanager
def saved_model(
    model: nn.Module, tokenizer: Any | None = None, *, state_dict: Mapping[str, Tensor] | None = None
) -> Iterator[dict[str, Path]]:
    """:func:`model_files` as ``{file name: path}`` in a temporary folder (removed on exit), sorted by
    name: GBs of weights go to the store from there (``StageWriter.write_bytes`` takes a path)
    without a bytes copy in memory."""
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
        yield {p.name: p for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def state_bytes(state: Mapping[str, Any]) -> bytes:
    """Serialise trainer state (tensors, numbers, strings, nested dicts/lists)."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


def save_state(state: Mapping[str, Any], path: Path) -> None:
    """Serialise trainer state into the file ``path``, streamed: each tensor's storage goes from
    memory to the file, no serialised copy is built (peak memory: the tensors only). Through a file
    object, so the archive's records are named ``archive/...`` whatever the path: the bytes are
    :func:`state_bytes`'s."""
    with open(path, "wb") as f:
        torch.save(dict(state), f)


def load_state_bytes(data: bytes, where: str) -> dict[str, Any]:
    """Inverse of :func:`state_bytes` through the restricted (weights-only) unpickler."""
    return _checked_load(lambda: torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"), where)


def load_state(path: Path, where: str) -> dict[str, Any]:
    """Inverse of :func:`save_state`, memory-mapped: a tensor's pages are read from the file when
    first touched (copied on write), so no second copy of the file is ever in memory. The mapping
    holds the file's disk space until the tensors are freed, also once the file is deleted (a pruned
    checkpoint, a removed download)."""
    return _checked_load(lambda: torch.load(path, weights_only=True, map_location="cpu", mmap=True), where)


def _checked_load(load: Any, where: str) -> dict[str, Any]:
    """Run ``load``; a failure or a non-dict is an :class:`ArtifactCorruptError` naming ``where``."""
    try:
        state = load()
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


def seed_rngs(seed: int) -> None:
    """Seed torch's and Python's global RNGs. Python's is seeded too although verl-flow draws from
    its own ``random.Random`` instances: unseeded, it starts from ``os.urandom``, so the state that
    :func:`rng_state` saves differed between two identical runs from the first checkpoint on, and so
    did their ``trainer_state.pt`` bytes. Seeded, they agree until a library draws from it at
    wall-clock-dependent moments (Prefect's service loops jitter their intervals with
    ``random.uniform``, ``prefect.utilities.math``): later checkpoints may hold another position in
    the same stream."""
    import random

    torch.manual_seed(seed)
    random.seed(seed)


def set_rng_state(state: Mapping[str, Any]) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
