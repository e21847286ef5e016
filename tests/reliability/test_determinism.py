"""The determinism contract at the quickstart's geometry (configs/quickstart.yaml: its model, batch of
32 prompts × 4 samples, PPO with a GAE critic; a short SFT and 3 RL iterations): two runs started
together (each the other's CPU load), one uninterrupted and one killed with SIGKILL at its second
checkpoint, the latter resumed (beside the other pytest-xdist worker's tests), end with the same
fingerprint — every committed table and tensor (``conftest.fingerprint``: sha256 per file, wall-clock
values left out; ``benchmarks/determinism.py`` repeats whole runs beside busy loops). The tiny
config's runs do not show the float differences this geometry showed: reruns differed from the first
update on (training gathers accumulated in thread order, tests/verl_core/models/test_determinism.py),
and resumed runs in the critic (read back from the checkpoint at another memory alignment,
tests/verl_core/models/test_loading.py)."""

from __future__ import annotations

import signal
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
    stores = {name: str(tmp_path / name) for name in ("first", "killed")}
    point = "checkpoint-save"  # ckpt/iter-0002: policy and critic written, trainer state not
    t0 = time.perf_counter()
    first = pipeline.start(stores["first"], "det", overrides=SHORT, config=QUICKSTART)
    killed = pipeline.start(stores["killed"], "det", overrides=SHORT, config=QUICKSTART, kill_at=point)
    done, died = finish(first, t0, timeout=600), finish(killed, t0, timeout=600)
    assert done.returncode == 0, done.output[-4000:]
    assert died.returncode == -signal.SIGKILL and died.killed_at() == point, died.output[-4000:]
    reference = fingerprint(stores["first"], "det")
    assert any(k.endswith("critic/model.safetensors") for k in reference)
    before = attempts(stores["killed"], "det")
    assert "ckpt/iter-0001" in before and "ckpt/iter-0002" not in before

    resumed = pipeline.run(stores["killed"], "det", overrides=SHORT, config=QUICKSTART, timeout=600)
    assert resumed.returncode == 0, resumed.output[-4000:]
    after = attempts(stores["killed"], "det")
    assert {s: after[s] for s in before} == before  # nothing committed was redone
    assert _differences(fingerprint(stores["killed"], "det"), reference) == []
