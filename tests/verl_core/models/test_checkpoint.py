"""Trainer state as a file: streamed save, memory-mapped load, the same bytes as the in-memory form,
an exact round trip; and a saved Python RNG state that two identical runs agree on."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from verl_core.errors import ArtifactCorruptError
from verl_core.models.checkpoint import load_state, rng_state, save_state, state_bytes

REPO = Path(__file__).resolve().parents[3]


def _state(mib: int) -> dict[str, Any]:
    """An AdamW-like trainer state holding ``mib`` MiB of float32 moments (two tensors)."""
    g = torch.Generator().manual_seed(0)
    n = mib * 2**20 // 8  # float32 elements per tensor: 2 tensors × 4 bytes
    return {
        "actor": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(n, generator=g)}}},
        "critic": {"state": {0: {"exp_avg_sq": torch.rand(n, generator=g)}}},
        "rng": rng_state(),
        "iteration": 3,
        "history": [(1, "loss", 0.5)],
    }


def test_file_round_trip_is_exact_and_has_the_in_memory_bytes(tmp_path: Path) -> None:
    state = _state(1)
    path = tmp_path / "trainer_state.pt"
    save_state(state, path)
    # the archive's records are named archive/... through a file object, whatever the file is called:
    # the file is byte for byte what state_bytes gave before checkpoints were streamed
    assert path.read_bytes() == state_bytes(state)
    back = load_state(path, "test")
    assert back["iteration"] == 3 and back["history"] == [(1, "loss", 0.5)]
    for role, key in (("actor", "exp_avg"), ("critic", "exp_avg_sq")):
        assert torch.equal(back[role]["state"][0][key], state[role]["state"][0][key])
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["rng"]["python"] == state["rng"]["python"]


def test_a_truncated_state_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "trainer_state.pt"
    save_state(_state(1), path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ArtifactCorruptError, match=r"ckpt/iter-0001/trainer_state\.pt: not a loadable"):
        load_state(path, "ckpt/iter-0001/trainer_state.pt")


_PEAKS = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    sys.path.insert(0, sys.argv[3])
    from tests.verl_core.models.test_checkpoint import _state
    from verl_core.models.checkpoint import load_state, load_state_bytes, save_state, state_bytes

    def vm_mib(field):  # VmRSS (resident now) or VmHWM (its high-water mark) from /proc, in MiB
        line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
        return int(line.split()[1]) / 1024

    def growth(fn):
        # the peak over what is resident now: the high-water mark is reset first (clear_refs 5), so a
        # peak reached before (the state's own random fill) cannot hide this one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = vm_mib("VmRSS")
        kept = fn()
        return vm_mib("VmHWM") - base, kept

    mib, path = int(sys.argv[1]), Path(sys.argv[2])
    state = _state(mib)
    out = {}
    out["save"], _ = growth(lambda: save_state(state, path))
    out["load"], back = growth(lambda: load_state(path, "test"))
    out["save_as_bytes"], _ = growth(lambda: len(state_bytes(state)))  # the in-memory form, as before
    # the file read whole, then unpickled from it
    out["load_from_bytes"], _ = growth(lambda: len(load_state_bytes(path.read_bytes(), "test")))
    out["exact"] = all(  # last: it reads every mapped page (the peak is a high-water mark)
        torch.equal(back[r]["state"][0][k], state[r]["state"][0][k])
        for r, k in (("actor", "exp_avg"), ("critic", "exp_avg_sq"))
    )
    print(json.dumps(out))
    """
)


def test_saving_and_loading_a_state_does_not_copy_it_in_memory(tmp_path: Path) -> None:
    mib = 128
    done = subprocess.run(
        [sys.executable, "-c", _PEAKS, str(mib), str(tmp_path / "s.pt"), str(REPO)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\npeak RSS growth over a {mib} MiB state (MiB): {peaks}")
    assert peaks["exact"]
    # in memory, the serialised copy alone is 128 MiB beside the tensors (2N in all); streamed to the
    # file, each storage goes from the tensor to the file: growth far below N. Memory-mapped, the load
    # reads no page until it is touched; the equality check touches them all, after the measurement
    assert peaks["save_as_bytes"] >= 0.9 * mib
    assert peaks["save"] < 0.25 * mib
    assert peaks["load"] < 0.25 * mib
    assert peaks["load_from_bytes"] >= 1.8 * mib  # read whole: the bytes and the tensors, 2N


_SAVED_RNG = textwrap.dedent(
    """
    import hashlib, sys
    sys.path.insert(0, sys.argv[1])
    from verl_core.models.checkpoint import rng_state, seed_rngs, state_bytes
    seed_rngs(7)
    print(hashlib.sha256(state_bytes({"rng": rng_state()})).hexdigest())
    """
)


def test_two_processes_seeded_alike_save_the_same_rng_bytes() -> None:
    # Python's global generator starts from os.urandom in each process: without seed_rngs seeding it,
    # the python part of the saved RNG state (and so trainer_state.pt) differed between identical runs
    def saved() -> str:
        run = subprocess.run(
            [sys.executable, "-c", _SAVED_RNG, str(REPO)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return run.stdout.strip()

    assert saved() == saved()
