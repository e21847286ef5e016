"""One seed mixer for every random stream of a run.

Why a hash and not arithmetic: the old mixers (``seed + iteration``, ``seed * 7919 + epoch``,
``seed * 1_000_003 + iteration``) made different streams collide: seed 1 at iteration 1 drew exactly the
stream of seed 2 at iteration 0, so two runs "with different seeds" shared most of their mini-batch
orders. Hashing the whole tuple, with a name per use, gives every (use, seed, step, ...) its own stream.
"""

from __future__ import annotations

import hashlib
import operator


def derive_seed(*parts: int | str) -> int:
    """A seed in [0, 2⁶³) for the random stream named by ``parts``, e.g.
    ``derive_seed("minibatch", trainer_seed, iteration, epoch)``: equal parts → equal seed; any part
    different → an unrelated seed (BLAKE2b of the parts, unit-separated so ("1", "2") ≠ ("12",))."""
    if not parts:
        raise ValueError("derive_seed needs at least one part")
    # integers of any type (numpy, bool) are the same part as the int they equal; strings stay apart
    data = "\x1f".join(
        f"str:{p}" if isinstance(p, str) else f"int:{operator.index(p)}" for p in parts
    ).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1
