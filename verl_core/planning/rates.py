"""Matmul rates at a model's own shapes: what :mod:`verl_core.planning.cost` divides FLOPs by.

One plain ``1024 × 1024`` matmul rate misses how fast a model's matmuls really run: on CPU a
``(T, 512) · (512, 1408)`` projection of a 34M model reaches a fraction of it, a ``(T, 896) ·
(896, 4864)`` one of Qwen2.5-0.5B nearly all of it, and the LM head ``(T, h) · (h, V)`` more still.
So the rate is measured per weight shape ``(in, out)`` of the model (:func:`weight_shapes`: the
attention's q, k/v and o projections, the MLP's gate/up and down, the LM head) and per pass:

* ``fwd``: ``(T, in) · (in, out)``, the forward;
* ``dx``: ``(T, out) · (out, in)``, the input's gradient;
* ``dw``: ``(in, T) · (T, out)``, the weight's gradient (the sum runs over the tokens);

at a few token counts (:data:`ANCHOR_TOKENS`), interpolated linearly in ``log T`` between them (held
at the ends). A phase's FLOP seconds are then ``Σ_shapes count · 2·T·in·out / rate(shape, pass, T)``
(:func:`matmul_seconds`), with ``T`` the tokens of one call of that matmul: a micro-batch's for the
decoder layers, one LM-head chunk's (:func:`verl_core.planning.memory_terms.chunk_tokens`) for the head.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_core.planning.geometry import Geometry

ANCHOR_TOKENS = (64, 256, 1024)
PASSES = ("fwd", "dx", "dw")


def weight_shapes(g: Geometry) -> dict[str, tuple[int, int, int]]:
    """``{name: (in, out, count)}``: the model's matmul weights, ``count`` of them per forward
    (q and o per layer, k and v, gate and up: two per layer; the LM head once)."""
    h, d, i = g.hidden_size, g.head_dim, g.intermediate_size
    return {
        "q": (h, g.num_heads * d, g.num_layers),
        "kv": (h, g.num_kv_heads * d, 2 * g.num_layers),
        "o": (g.num_heads * d, h, g.num_layers),
        "up": (h, i, 2 * g.num_layers),
        "down": (i, h, g.num_layers),
        "head": (h, g.vocab_rows, 1),
    }


@dataclass(frozen=True)
class ShapeRates:
    """Measured FLOP/s: ``rates[(shape, pass)][k]`` at ``tokens[k]`` tokens (sorted)."""

    tokens: tuple[int, ...]
    rates: dict[tuple[str, str], tuple[float, ...]] = field(default_factory=dict)

    def rate(self, shape: str, kind: str, tokens: float) -> float:
        """FLOP/s of ``shape``'s ``kind`` pass at ``tokens``: linear in ``log T`` between anchors."""
        r, ts = self.rates[(shape, kind)], self.tokens
        if tokens <= ts[0]:
            return r[0]
        if tokens >= ts[-1]:
            return r[-1]
        k = bisect.bisect_right(ts, tokens)
        x = (math.log(tokens) - math.log(ts[k - 1])) / (math.log(ts[k]) - math.log(ts[k - 1]))
        return r[k - 1] + x * (r[k] - r[k - 1])

    def to_json(self) -> dict[str, object]:
        return {
            "tokens": list(self.tokens),
            "rates": {f"{s}/{p}": list(v) for (s, p), v in self.rates.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShapeRates:
        rates = {}
        for key, values in data["rates"].items():
            shape, kind = key.split("/")
            rates[(shape, kind)] = tuple(float(v) for v in values)
        return cls(tuple(int(t) for t in data["tokens"]), rates)


def matmul_seconds(
    g: Geometry,
    rates: ShapeRates,
    backbone_tokens: float,
    head_tokens: float,
    head_chunk: int,
    passes: tuple[str, ...],
) -> float:
    """Seconds of the decoder layers' matmuls on ``backbone_tokens`` (one call) and the LM head's on
    ``head_tokens`` in chunks of at most ``head_chunk`` (0 head tokens: no head, a critic), each pass
    of ``passes`` at its measured rate: ``Σ count · 2·T·in·out / rate``."""
    total = 0.0
    for name, (i, o, count) in weight_shapes(g).items():
        t = head_tokens if name == "head" else backbone_tokens
        if t <= 0:
            continue
        call = min(t, head_chunk) if name == "head" else t  # tokens of one matmul call
        total += sum(count * 2.0 * t * i * o / rates.rate(name, kind, call) for kind in passes)
    return total


def _operands(i: int, o: int, t: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "fwd":
        return torch.randn(t, i), torch.randn(i, o)
    if kind == "dx":
        return torch.randn(t, o), torch.randn(o, i)
    return torch.randn(t, i).T, torch.randn(t, o)  # dw = xᵀ·dy: x stored (T, in), read transposed


def measure_shape_rates(
    g: Geometry, tokens: tuple[int, ...] = ANCHOR_TOKENS, seconds: float = 0.1, sweeps: int = 3
) -> ShapeRates:
    """fp32 rates of every shape of :func:`weight_shapes` and pass of :data:`PASSES` at ``tokens``,
    on the CPU with torch's current threads: each the best of repeats for about ``seconds``, over
    ``sweeps`` sweeps of every entry (a shared machine's load comes and goes: a sweep that caught it
    for one entry misses it in another)."""
    best: dict[tuple[str, str, int], float] = {}
    for _ in range(sweeps):
        for name, (i, o, _) in weight_shapes(g).items():
            for kind in PASSES:
                for t in tokens:
                    a, b = _operands(i, o, t, kind)
                    torch.matmul(a, b)
                    key, t0 = (name, kind, t), time.perf_counter()
                    while time.perf_counter() - t0 < seconds:
                        t1 = time.perf_counter()
                        torch.matmul(a, b)
                        best[key] = min(best.get(key, math.inf), time.perf_counter() - t1)
    rates = {
        (name, kind): tuple(2.0 * t * i * o / best[(name, kind, t)] for t in tokens)
        for name, (i, o, _) in weight_shapes(g).items()
        for kind in PASSES
    }
    return ShapeRates(tuple(tokens), rates)


def measure_cpu_matmul_rate(n: int = 1024, seconds: float = 1.0) -> float:
    """FLOP/s of fp32 ``n × n`` by ``n × n`` matmuls (``2·n³`` each) on the CPU with torch's current
    threads, repeated for about ``seconds``: the denominator of the CPU features."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)  # warm-up
    reps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or reps < 2:
        torch.matmul(a, b)
        reps += 1
    return 2.0 * n**3 * reps / elapsed


def measure_cpu_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes read + written per second by ``b.copy_(a)`` of two ``nbytes`` fp32 tensors on the CPU
    with torch's current threads (the best of ``repeats``, after a warm-up that touches every page):
    the denominator of the memory features."""
    a, b = torch.ones(nbytes // 4), torch.zeros(nbytes // 4)
    b.copy_(a)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * nbytes / best


def measure_write_bandwidth(folder: str, nbytes: int = 512 << 20, chunk: int = 16 << 20) -> float:
    """Bytes per second written into a new file in ``folder`` and made durable (``fsync``), as the
    artifact store writes a checkpoint's files: the denominator of the checkpoint-save feature."""
    import os
    import tempfile

    block = os.urandom(chunk)
    fd, path = tempfile.mkstemp(dir=folder, prefix=".write-bandwidth-")
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, nbytes // chunk)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return max(1, nbytes // chunk) * chunk / (time.perf_counter() - t0)
    finally:
        os.unlink(path)
