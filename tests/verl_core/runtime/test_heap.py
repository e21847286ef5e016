"""glibc's heap settings of an RL session (verl_core/runtime/heap.py). Retained: a 64 MiB tensor comes
from the heap, not a mapping of its own, and once freed its pages stay resident for the next one until
the heap is trimmed. glibc's defaults (restored): the same tensor gets a mapping, unmapped when freed."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from verl_core.runtime import heap
from verl_core.runtime.heap import restore_heap, retain_freed_heap, trim_heap

pytestmark = pytest.mark.skipif(heap._libc() is None, reason="glibc's mallopt / malloc_trim only")

BLOCK = 64 * 2**20  # above the largest mmap threshold glibc ever sets by itself (32 MiB)


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                     "fordblks", "keepcost")
    ]  # fmt: skip


def mapped_bytes() -> int:
    """Bytes of the blocks glibc gave mappings of their own (``mallinfo2().hblkhd``)."""
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    return int(mallinfo2().hblkhd)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_retained_a_freed_tensor_stays_resident_in_the_heap_until_trimmed() -> None:
    assert retain_freed_heap()
    try:
        before = mapped_bytes()
        x = torch.ones(BLOCK // 4)  # every page touched: resident
        assert mapped_bytes() == before  # from the heap
        resident = resident_bytes()
        del x
        # freed, its 64 MiB stay (a few pages may move); trimmed, they go (at least 3/4 of them)
        assert resident_bytes() > resident - BLOCK // 8
        trim_heap()
        assert resident_bytes() < resident - 3 * BLOCK // 4
    finally:
        restore_heap()


def test_with_glibcs_defaults_a_large_tensor_gets_a_mapping_unmapped_when_freed() -> None:
    restore_heap()
    before = mapped_bytes()
    x = torch.ones(BLOCK // 4)
    assert mapped_bytes() >= before + BLOCK
    del x
    assert mapped_bytes() == before
