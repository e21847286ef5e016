"""Weight sync to an engine that holds its own weights (vLLM): staged safetensors buckets, checked names.

The trainer writes the policy's tensors, ``(name, tensor)`` in state-dict order, into a fresh staging
directory as safetensors files of at most ``bucket_bytes`` each (:func:`stage_weights`); the engine
reads the directory (vLLM: ``worker.reload_weights(weights_path=DIR)``, memory-mapped) and the
directory is removed. The files are written straight from the tensors' memory
(:func:`write_safetensors`: the safetensors layout, no intermediate copy; a tensor is copied only to
cast it to the engine's dtype or off a device, one at a time), so the trainer holds at most one cast
tensor beyond its own weights; the staged copy lives in the staging directory (``/dev/shm`` where
there is one: RAM, not the trainer's heap) until the engine has read it. A tensor larger than a bucket
is a bucket of its own. (``safetensors.torch.save_file`` copied every tensor twice first, into fresh
pages the kernel zeroes: at Qwen2.5-0.5B's 2.5 GB of fp32 weights 0.29 GB/s against 0.77 GB/s
written directly, benchmarks/RESULTS.md.)

The whole model is staged before the engine reads any of it, so ``/dev/shm`` must hold the model's
bytes: Docker's default ``/dev/shm`` is 64 MB (a 0.5B model in bf16 is ~1 GB). Where its free space
(``os.statvfs``) is too small, :func:`staging_root` stages on disk (the system temp directory) and
says once how to give the container more (``--shm-size`` / ``--ipc=host``, a memory ``emptyDir`` in
Kubernetes); ``verl-flow doctor --config`` reports the same against the config's model.

Every sync is checked against the names the engine's model expects (:func:`check_weight_names`): a
missing tensor (e.g. ``lm_head.weight`` of a tied-embedding model, which ``named_parameters()``
drops — without it vLLM's CPU backend keeps a stale output projection and samples wrong tokens
silently) or an extra one fails before the engine is touched, naming them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from verl_core.errors import ConfigError

log = logging.getLogger(__name__)

SHM = "/dev/shm"
SHM_FIX = (
    "give the container a larger /dev/shm: docker run --shm-size=<size> (or --ipc=host); "
    "in Kubernetes a memory emptyDir mounted on /dev/shm"
)
_warned: list[bool] = []  # [True] once this process has logged the fallback
# the safetensors format's dtype names (https://github.com/huggingface/safetensors, format docs)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


def shm_space() -> tuple[int, int] | None:
    """``(free, total)`` bytes of the file system at :data:`SHM` (``os.statvfs``; free as an
    unprivileged process sees it), or None where it is not a writable directory."""
    if not (os.path.isdir(SHM) and os.access(SHM, os.W_OK)):
        return None
    st = os.statvfs(SHM)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def shm_needed(nbytes: int) -> int:
    """The free bytes a sync of ``nbytes`` of tensors needs: the tensors plus 1/16 for the files'
    headers (names, shapes, offsets: a few hundred bytes per tensor) and what else writes there."""
    return nbytes + nbytes // 16


def shm_shortfall(nbytes: int, space: tuple[int, int] | None) -> str | None:
    """One line saying why ``/dev/shm`` (``space``: free, total) cannot stage ``nbytes`` of weights,
    naming the fix; None when it can (or when there is no ``/dev/shm``: nothing to fix there)."""
    if space is None or shm_needed(nbytes) <= space[0]:
        return None
    free, total = space
    return (
        f"{SHM} has {mib(free)} free of {mib(total)}, a weight sync stages {mib(nbytes)}: "
        f"{SHM_FIX} (staging on disk meanwhile, slower)"
    )


def mib(nbytes: int) -> str:
    """``nbytes`` in MiB for messages: ``1,024 MiB``."""
    return f"{nbytes / 2**20:,.0f} MiB"


def staging_root(nbytes: int = 0) -> str:
    """Where a sync of ``nbytes`` of tensors is staged: ``/dev/shm`` (RAM-backed) when it exists, is
    writable and has the free space (:func:`shm_needed`), else the system temp directory (on disk),
    logged once per process with the fix (:func:`shm_shortfall`). ``nbytes=0``: any free space."""
    space = shm_space()
    if space is None:
        return tempfile.gettempdir()
    problem = shm_shortfall(nbytes, space)
    if problem is None:
        return SHM
    if not _warned:
        _warned.append(True)
        log.warning("weight sync: %s", problem)
    return tempfile.gettempdir()


def write_safetensors(
    tensors: Sequence[tuple[str, Tensor]], path: str | Path, dtype: torch.dtype | None = None
) -> None:
    """``tensors`` as one safetensors file at ``path``: an 8-byte little-endian header length, the JSON
    header (name → dtype, shape, ``[begin, end)`` byte offsets), padded with spaces to 8 bytes, then
    each tensor's bytes in the order given, written from its own memory (CPU, contiguous, floating
    ones already in ``dtype`` when given; anything else is converted first, one tensor at a time).
    Two names of one storage (tied weights) are written twice, as safetensors' loaders expect."""
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors:
        out = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if out not in SAFETENSORS_DTYPES:
            raise ConfigError(f"weight sync: {name!r} has dtype {out}, not a safetensors dtype")
        nbytes = t.numel() * out.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[out], "shape": list(t.shape)}
        header[name]["data_offsets"] = [offset, offset + nbytes]
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for _, t in tensors:
            out = dtype if dtype is not None and t.is_floating_point() else t.dtype
            flat = t.detach().to("cpu", dtype=out).contiguous().reshape(-1)  # no copy when it is so
            f.write(flat.view(torch.uint8).numpy().data)  # a memoryview of the tensor: no copy


def stage_weights(
    weights: Iterable[tuple[str, Tensor]],
    directory: str | Path,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
) -> list[str]:
    """Write ``weights`` into ``directory`` (created) as ``bucket-00000.safetensors``, ... of at most
    ``bucket_bytes`` each (a larger tensor alone in its file), in the order given; returns the names
    written (:func:`write_safetensors`). Floating tensors are cast to ``dtype`` when given (the
    engine's compute dtype: it would cast them on load, with the same rounding), one at a time as
    they are written."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    seen: set[str] = set()
    bucket: list[tuple[str, Tensor]] = []
    size = files = 0

    def flush() -> None:
        nonlocal bucket, size, files
        if bucket:
            write_safetensors(bucket, out / f"bucket-{files:05d}.safetensors", dtype)
            files += 1
        bucket, size = [], 0

    for name, tensor in weights:
        if name in seen:
            raise ConfigError(f"weight sync: tensor {name!r} is sent twice")
        seen.add(name)
        nbytes = staged_bytes(tensor, dtype)
        if bucket and size + nbytes > bucket_bytes:
            flush()
        bucket.append((name, tensor))
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


def meta_state_dict(config: Any, *, trust_remote_code: bool = False) -> dict[str, Tensor]:
    """The state dict of the HF causal LM of ``config`` (an HF ``PretrainedConfig``) built on the meta
    device (shapes only, no memory), tied weights included, non-persistent buffers excluded."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return model.state_dict()


def expected_weight_names(model_dir: str, *, trust_remote_code: bool = False) -> list[str]:
    """The state-dict names of the HF causal LM in ``model_dir`` (:func:`meta_state_dict` of its
    config: no weights read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    return list(meta_state_dict(config, trust_remote_code=trust_remote_code))


def sync_bytes(config: Any, element_size: int, *, trust_remote_code: bool = False) -> int:
    """The bytes a full weight sync of the HF causal LM of ``config`` stages: every state-dict tensor
    (a tied one once per name, as :func:`stage_weights` writes it) at ``element_size`` bytes."""
    tensors = meta_state_dict(config, trust_remote_code=trust_remote_code).values()
    return sum(t.numel() for t in tensors) * element_size


def staged_bytes(tensor: Tensor, dtype: torch.dtype | None = None) -> int:
    """The bytes ``tensor`` takes once staged: cast to ``dtype`` when it is floating."""
    if dtype is not None and tensor.is_floating_point():
        return tensor.numel() * dtype.itemsize
    return tensor.numel() * tensor.element_size()


@contextmanager
def staged_weights(
    weights: Iterable[tuple[str, Tensor]],
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    syncs_per_node: int = 1,
) -> Iterator[str]:
    """``weights`` staged (:func:`stage_weights`, floating tensors cast to ``dtype``) in a fresh
    directory sized for their bytes; yields the directory, removed on exit. The pairs are listed first
    to add up their sizes: pass a state dict's ``items()`` (references, no copies).

    ``syncs_per_node``: the syncs that stage at once on this machine (an SPMD job's engines sync
    together, each into its own directory of the one ``/dev/shm``): ``/dev/shm`` must hold all of them,
    else this one stages on disk. Free space read before writing can still run out under writers this
    process does not know of: a ``/dev/shm`` that fills up (ENOSPC) mid-sync is given up for the disk,
    said once, and the sync goes on."""
    items = list(weights)
    nbytes = sum(staged_bytes(t, dtype) for _, t in items)
    root = staging_root(nbytes * max(1, syncs_per_node))
    directory = tempfile.mkdtemp(prefix="verl-flow-sync-", dir=root)
    try:
        try:
            stage_weights(items, directory, bucket_bytes, dtype)
        except OSError as e:
            if e.errno != errno.ENOSPC or root != SHM:
                raise
            shutil.rmtree(directory, ignore_errors=True)
            if not _warned:
                _warned.append(True)
                log.warning("weight sync: %s filled up (%s): %s (staging on disk, slower)", SHM, e, SHM_FIX)
            directory = tempfile.mkdtemp(prefix="verl-flow-sync-", dir=tempfile.gettempdir())
            stage_weights(items, directory, bucket_bytes, dtype)
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
