"""Weight sync to an engine that holds its own weights (vLLM): staged safetensors buckets, checked names.

The trainer writes the policy's tensors, ``(name, tensor)`` in state-dict order, into a fresh staging
directory as safetensors files of at most ``bucket_bytes`` each (:func:`stage_weights`); the engine
reads the directory (vLLM: ``worker.reload_weights(weights_path=DIR)``, memory-mapped) and the
directory is removed. Memory: the trainer process holds one bucket beyond its own weights while it
writes (the bytes of one file); the staged copy lives in the staging directory (``/dev/shm`` where
there is one: RAM, not the trainer's heap) until the engine has read it. A tensor larger than a bucket
is a bucket of its own.

Every sync is checked against the names the engine's model expects (:func:`check_weight_names`): a
missing tensor (e.g. ``lm_head.weight`` of a tied-embedding model, which ``named_parameters()``
drops — without it vLLM's CPU backend keeps a stale output projection and samples wrong tokens
silently) or an extra one fails before the engine is touched, naming them.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from verl_core.errors import ConfigError

SHM = "/dev/shm"


def staging_root() -> str:
    """Where sync directories are staged: ``/dev/shm`` (RAM-backed) when it exists and is writable,
    else the system temp directory."""
    return SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else tempfile.gettempdir()


def stage_weights(
    weights: Iterable[tuple[str, Tensor]], directory: str | Path, bucket_bytes: int
) -> list[str]:
    """Write ``weights`` into ``directory`` (created) as ``bucket-00000.safetensors``, ... of at most
    ``bucket_bytes`` each (a larger tensor alone in its file), in the order given; returns the names
    written. Tensors are copied to the CPU one bucket at a time; a tensor sharing storage with another
    of the same bucket (tied embeddings) is written as its own copy (safetensors refuses aliases)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    seen: set[str] = set()
    bucket: dict[str, Tensor] = {}
    size = files = 0

    def flush() -> None:
        nonlocal bucket, size, files
        if bucket:
            save_file(bucket, str(out / f"bucket-{files:05d}.safetensors"))
            files += 1
        bucket, size = {}, 0

    for name, tensor in weights:
        if name in seen:
            raise ConfigError(f"weight sync: tensor {name!r} is sent twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
        # a fresh contiguous CPU copy: no alias of another tensor of the bucket, no view of a shard
        bucket[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += nbytes
        names.append(name)
    flush()
    return names


def staged_names(directory: str | Path) -> list[str]:
    """The tensor names in a staging directory's bucket files (headers only: nothing is loaded)."""
    names: list[str] = []
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        names.extend(k for k in header if k != "__metadata__")
    return names


def check_weight_names(sent: Sequence[str], expected: Iterable[str], what: str = "weight sync") -> None:
    """Raise :class:`ConfigError` unless ``sent`` holds exactly the ``expected`` names, each once: the
    message names up to 8 missing and 8 unexpected tensors."""
    expected_set, sent_set = set(expected), set(sent)
    missing = sorted(expected_set - sent_set)
    extra = sorted(sent_set - expected_set)
    if not missing and not extra:
        return
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} tensor(s) {missing[:8]}")
    if extra:
        parts.append(f"unexpected {len(extra)} tensor(s) {extra[:8]}")
    raise ConfigError(
        f"{what}: the payload does not match the engine's model: {'; '.join(parts)} (send every tensor of "
        "the model's state_dict(), tied ones included, e.g. lm_head.weight of a tied-embedding model)"
    )


def expected_weight_names(model_dir: str, *, trust_remote_code: bool = False) -> list[str]:
    """The state-dict names of the HF causal LM in ``model_dir`` (built on the meta device from its
    config: no weights read), tied weights included, non-persistent buffers excluded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return list(model.state_dict().keys())


class StagingDir:
    """A fresh directory under :func:`staging_root` for one sync, removed on exit."""

    def __init__(self, prefix: str = "verl-flow-sync-") -> None:
        self.path = tempfile.mkdtemp(prefix=prefix, dir=staging_root())

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: Any) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
