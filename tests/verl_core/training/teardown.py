"""How a torchrun test worker ends: :func:`end_worker`.

Why not just ``destroy_process_group()`` and return. ``destroy_process_group`` drops torch's own
references to the groups, but gloo's ``shutdown`` does nothing: its worker threads stop only in the
C++ group's destructor, when the last reference goes. DeepSpeed keeps references for the life of
the process (``deepspeed.utils.groups._WORLD_GROUP``, every ZeRO-3 parameter's ``ds_process_group``,
the ZeRO-3 ``Init`` context; seen after ``destroy_process_group`` and ``gc.collect()`` with the gloo
threads still running), so that destructor runs during interpreter finalization. A gloo thread that
is still freeing its last collective's tensor then needs the GIL (the tensor's Python object is
owned by C++ once Python dropped it first); CPython ends a thread that takes the GIL while the
interpreter finalizes with ``pthread_exit``, whose forced unwind through a ``noexcept`` C++
destructor calls ``std::terminate``: "terminate called without an active exception", SIGABRT, after
the worker did all its work (seen 1 run in 74; a standalone two-rank script whose main thread holds
the GIL while its last all_reduce completes shows it, though not on every run).

A worker that ends with ``os._exit`` after its results are written and closed never finalizes the
interpreter, so no thread can meet a finalizing one.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import torch.distributed as dist


def end_worker() -> NoReturn:
    """Every rank done (rank 0 has written and closed the results), the groups destroyed, stdout and
    stderr flushed, exit code 0 without interpreter finalization (the module docstring says why)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
