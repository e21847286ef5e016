"""One seed mixer for every random stream of a run.

Why a hash and not arithmetic: the old mixers (``seed + iteration``, ``seed * 7919 + epoch``,
``seed * 1_000_003 + iteration``) made different streams collide: seed 1 at iteration 1 drew exactly the
stream of seed 2 at iteration 0, so two runs "with different seeds" shared most of their mini-batch
orders. Hashing the whole tuple, with a name per use, gives every (use, seed, step, ...) its own stream.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch stays out of this module's imports (data cleaning uses it without torch)
    from torch import Tensor


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


# -- per-row uniforms for sampling: a counter-based hash, vectorised ----------------------------------
#
# Token sampling draws one uniform per (row, generation step). To make a row's draws independent of
# the batch it is generated in (a sharded rollout must sample exactly the tokens of one process), the
# uniform is a pure function of the row's key (``derive_seed("sample", seed, prompt_key, sample)``)
# and the step, not a draw from a stateful RNG: u = splitmix64(key + (step + 1)·γ) / 2⁶⁴, the step-th
# output of Steele, Lea & Flood's SplitMix64 ("Fast splittable pseudorandom number generators",
# OOPSLA 2014) seeded with the key. Computed with int64 tensor ops on any device: additions and
# products wrap modulo 2⁶⁴ (two's complement), and ``>>`` on int64 is arithmetic, so a logical
# shift right by s is ``(x >> s) & (2^(64-s) - 1)``.

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # 2⁶⁴ / golden ratio, SplitMix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as unsigned ``x``."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 ``x`` by ``s`` bits (torch's ``>>`` copies the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: Tensor) -> Tensor:
    """SplitMix64's output function on int64 ``x`` (any shape; bits read as unsigned 64-bit):
    z = (x ^ x>>>30)·M1; z = (z ^ z>>>27)·M2; z ^ z>>>31."""
    z = (x ^ _shr(x, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def counter_uniforms(keys: Tensor, step: int) -> Tensor:
    """Uniforms in [0, 1) ``(B,)`` float32 for int64 row ``keys (B,)`` at generation ``step`` ≥ 0: the
    top 24 bits of ``splitmix64(key + (step + 1)·γ)`` over 2²⁴ (exact in float32). Equal (key, step)
    → equal uniform, whatever else is in the batch."""
    import torch

    x = keys + _signed(((step + 1) * _GAMMA) & _MASK64)  # wraps modulo 2⁶⁴
    return _shr(splitmix64(x), 40).to(torch.float32) * (1.0 / (1 << 24))


def sample_keys(seed: int, prompt_keys: Sequence[int], sample_indices: Sequence[int]) -> list[int]:
    """Row keys of sampled rows: ``derive_seed("sample", seed, prompt_key, sample_index)`` each."""
    return [derive_seed("sample", seed, p, s) for p, s in zip(prompt_keys, sample_indices, strict=True)]
