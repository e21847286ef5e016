"""glibc's heap in a training process: what an update frees stays for its next micro-batch, and goes
back to the OS at the phases' boundaries.

By default glibc gives every allocation above its mmap threshold (128 KiB, rising to at most 32 MiB as
such blocks are freed) a mapping of its own and unmaps it when it is freed, and trims freed memory at
the heap's top beyond 128 KiB. A training step allocates the same tensors every micro-batch
(activations, logits chunks, gradients: GBs at 0.5B), so every micro-batch maps them again and the
kernel faults in and zeroes each page on first touch. Where a fault is expensive (a VM; memory short,
so each fault first reclaims page cache) that is a large share of the step: one 0.5B micro-batch
(``benchmarks/scale_step.py --sizes 0.5b --hold-gib 13``) took 6.4 s with 3.6 GB of fresh pages, and
4.8 s with ~0.06 GB once freed memory stayed in the heap.

:func:`retain_freed_heap` keeps it there (no mapping per allocation, no trimming) for the RL
session's life; :func:`trim_heap` returns the freed pages where
the memory is wanted elsewhere (before the rollout engine wakes, stages.floor.session);
:func:`restore_heap` puts glibc's defaults back. Threads other than the main one allocate from
their own arenas, which still map what exceeds one of their 64 MiB heaps: ``M_ARENA_MAX = 1`` makes
threads started after the call share the main arena. Not in vLLM's processes: started with the same
settings, the 0.5B engine's tree peaked 2.5 GiB higher (its reload's repacked layers stay in its heap).

Elsewhere (not Linux, not glibc) all three do nothing: allocators differ, the session works the same.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
# glibc's defaults (malloc.c: DEFAULT_MMAP_MAX, DEFAULT_TRIM_THRESHOLD)
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024


@cache
def _libc() -> ctypes.CDLL | None:
    """glibc, None elsewhere (musl has neither mallopt's parameters nor malloc_trim)."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def _mallopt(param: int, value: int) -> bool:
    libc = _libc()
    return libc is not None and bool(libc.mallopt(param, value))


def retain_freed_heap() -> bool:
    """Freed memory stays in this process's heap for its next allocations: nothing gets a mapping
    of its own (``M_MMAP_MAX = 0``), nothing is trimmed (``M_TRIM_THRESHOLD = -1``: never), threads
    started from now on share the main arena. True where glibc took the settings."""
    return all(
        [
            _mallopt(M_MMAP_MAX, 0),
            _mallopt(M_TRIM_THRESHOLD, -1),
            _mallopt(M_ARENA_MAX, 1),
        ]
    )


def trim_heap() -> None:
    """Return the heap's freed pages to the OS (``malloc_trim(0)``: the top and every free block)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def restore_heap() -> None:
    """glibc's defaults back (mappings for large blocks, trimming beyond 128 KiB), the freed pages
    returned. The arena limit stays (mallopt cannot unset it): threads started later share the
    arenas that exist."""
    _mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
    _mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
    trim_heap()
