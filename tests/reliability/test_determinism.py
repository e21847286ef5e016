"""The determinism contract at the quickstart's geometry (configs/quickstart.yaml: its model, batch of
32 prompts × 4 samples, PPO with a GAE critic; a short SFT and 3 RL iterations): two runs started
together (each the other's CPU load) and a run killed with SIGKILL at its second checkpoint and
resumed beside a busy loop all end with the same fingerprint — every committed table and tensor
(``conftest.fingerprint``: sha256 per file, wall-clock values left out). The tiny config's runs do not
show float differences (too few rows per gather for a second thread); this geometry did, from the
first update on, until the training gathers stopped accumulating in thread order
(tests/verl_core/models/test_determinism.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.reliability.conftest import REPO, Pipeline, attempts, fingerprint, finish

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
SHORT = [
    "trainer.total_iterations=3",
    "trainer.save_freq=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.max_ckpt_to_keep=3",  # keep iteration 1's checkpoint to compare its attempt
    "sft.max_steps=20",
    "eval.max_samples=16",
    "tracking.enabled=false",
]


def _differences(mine: dict[str, str], reference: dict[str, str]) -> list[str]:
    return sorted(k for k in mine.keys() | reference.keys() if mine.get(k) != reference.get(k))


def test_quickstart_reruns_and_a_killed_run_give_identical_artifacts(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    stores = {name: str(tmp_path / name) for name in ("first", "second", "killed")}
    t0 = time.perf_counter()
    procs = {
        name: pipeline.start(stores[name], "det", overrides=SHORT, config=QUICKSTART)
        for name in ("first", "second")
    }
    for name, proc in procs.items():
        r = finish(proc, t0, timeout=600)
        assert r.returncode == 0, f"{name}:\n{r.output[-4000:]}"
    reference = fingerprint(stores["first"], "det")
    assert any(k.endswith("policy/model.safetensors") for k in reference)
    assert _differences(fingerprint(stores["second"], "det"), reference) == []

    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # CPU load beside the resume
    try:
        point = "checkpoint-save"  # ckpt/iter-0002: policy and critic written, trainer state not
        killed = pipeline.run(
            stores["killed"], "det", overrides=SHORT, config=QUICKSTART, kill_at=point, timeout=600
        )
        assert killed.returncode == -signal.SIGKILL, killed.output[-4000:]
        assert killed.killed_at() == point, killed.output[-4000:]
        before = attempts(stores["killed"], "det")
        assert "ckpt/iter-0001" in before and "ckpt/iter-0002" not in before
        resumed = pipeline.run(stores["killed"], "det", overrides=SHORT, config=QUICKSTART, timeout=600)
        assert resumed.returncode == 0, resumed.output[-4000:]
    finally:
        busy.kill()
        busy.wait()
    after = attempts(stores["killed"], "det")
    assert {s: after[s] for s in before} == before  # nothing committed was redone
    assert _differences(fingerprint(stores["killed"], "det"), reference) == []
