"""Hardware figures shared by the benchmarks: the device and its name, the same-run matmul rate,
model FLOPs of training phases, achieved FLOP/s and peak memory.

FLOPs (counted on *real* tokens, so padding a side computes does not count as useful work):

* one token through the model's matmuls, forward: ``2·N`` where ``N`` = the weights of every
  ``nn.Linear`` (attention and MLP projections and the LM head; the embedding lookup is no matmul);
* causal attention scores and values of a sequence of length ``L``, forward: ``QKᵀ`` and ``AV`` are
  ``2·L²·d`` each for ``d`` = query heads × head dim, halved by the causal mask → ``2·L²·d`` per layer;
* forward + backward = 3 × forward (backward computes the gradients of activations and of weights):
  ``6·N·T + 6·n_layers·d·Σ L²`` (Kaplan et al. 2020, §2.1, "C ≈ 6NT", with the attention term);
  no-grad log-probs: ``2·N·T + 2·n_layers·d·Σ L²``.

Peak memory: CUDA ``torch.cuda.max_memory_allocated`` since the last :func:`reset_peak_memory`; CPU the
process's peak resident set size (``resource.getrusage``), which cannot be reset: the largest so far.
"""

from __future__ import annotations

import contextlib
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu; ``cpu`` / ``cuda`` as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch (a CPU build, or no GPU)")
    return torch.device(name)


def device_name(device: torch.device) -> str:
    """``NVIDIA H100 80GB HBM3`` / ``CPU <model>, N threads``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU {model}, {torch.get_num_threads()} torch thread(s)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a plain ``n × n`` by ``n × n`` ``torch.matmul`` (``2·n³`` FLOPs each) on ``device`` in
    ``dtype``, measured now: the denominator that says how far the model's passes are from it."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up (kernel selection, allocation)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.matmul(a, b)
    synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, FLOP/s: the fixed
# denominator of the GPU targets (issue 15: achieved ≥ 25% of it). Matched on the device name.
DENSE_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def dense_peak(device: torch.device) -> float | None:
    """The data-sheet dense bf16 peak of ``device`` (FLOP/s), or None when it is not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in DENSE_BF16_PEAK.items() if key in name), None)


def of_dense_peak(achieved: float, device: torch.device) -> str:
    """``", 27.1% of the dense bf16 peak (989 TFLOP/s)"``, or "" off the table."""
    peak = dense_peak(device)
    return (
        ""
        if peak is None
        else f", {100 * achieved / peak:.1f}% of the dense bf16 peak ({peak / 1e12:.0f} TFLOP/s)"
    )


def matmul_params(model: nn.Module) -> int:
    """``N``: weights of every ``nn.Linear`` (a tied LM head counts once, as the matmul it is)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def attention_width(config: Any) -> tuple[int, int]:
    """``(n_layers, d)`` of an HF decoder config: ``d`` = query heads × head dim."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_attention_heads * head_dim


def forward_flops(n_params: int, lengths: Sequence[int], n_layers: int, d: int) -> float:
    """One forward over sequences of ``lengths`` packed: ``2·N·T + 2·n_layers·d·Σ L²`` (causal)."""
    tokens = sum(lengths)
    return 2.0 * n_params * tokens + 2.0 * n_layers * d * sum(n * n for n in lengths)


def train_flops(n_params: int, lengths: Sequence[int], n_layers: int, d: int) -> float:
    """Forward + backward: 3 × :func:`forward_flops`."""
    return 3.0 * forward_flops(n_params, lengths, n_layers, d)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: bytes allocated at peak since :func:`reset_peak_memory`; CPU: the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_memory_label(device: torch.device) -> str:
    return "max_memory_allocated" if device.type == "cuda" else "peak RSS of the process (not resettable)"


_HOLD = "import sys, time, torch; x = torch.ones(int(float(sys.argv[1]) * 2**30) // 4); print(flush=True); "
_HOLD += "time.sleep(3600)"


@contextlib.contextmanager
def held_memory(gib: float) -> Iterator[None]:
    """Another process fills ``gib`` GiB and holds them until exit (nothing when 0): less memory for
    what runs meanwhile, as the reference, the moments and the vLLM engine leave at 0.5B."""
    if not gib:
        yield
        return
    hold = subprocess.Popen([sys.executable, "-c", _HOLD, str(gib)], stdout=subprocess.PIPE)
    try:
        assert hold.stdout is not None
        hold.stdout.readline()  # filled
        yield
    finally:
        hold.kill()
        hold.wait()
