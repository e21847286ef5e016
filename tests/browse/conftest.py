"""The rollout browser's fixture: one small finished GRPO run and a rescore of it, made once per
session in one process (the Prefect server it starts serves both flows).

The run (``tiny`` in the store): the reliability suite's tiny pipeline (scratch 2-layer Qwen2,
arithmetic prompts) without SFT, GRPO with 4 samples per prompt, 2 iterations of 4 prompts, validation
after each, an eval of the export with k=2 samples per held-out prompt; scored
by ``tests/flows/rl_rewards.py:half_credit`` (1.0 or 0.5 from the text's parity: some samples
correct, some not, groups with non-zero advantages). The rescore ``rule`` scores the training
rollouts again with the default rule scorer (arithmetic answers, which the scratch model never gets
right): every stored 1.0 becomes a disagreement."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN = "tiny"
RESCORE = "rule"
GROUP_SIZE = 4  # rollout.n
RUN_ARGS = [
    "run", "tests/reliability/tiny.yaml", "sft.enable=false", "algorithm.adv_estimator=grpo",
    f"rollout.n={GROUP_SIZE}", "data.train_batch_size=4", "trainer.test_freq=1", "eval.k=2",
    "reward.scorers=[function]",
    "reward.function=tests/flows/rl_rewards.py:half_credit", "--run-id", RUN,
]  # fmt: skip
RESCORE_ARGS = ["rescore", RUN, "reward.scorers=[rule]", "--iterations", "0:2", "--name", RESCORE]
# Both commands in one interpreter: the second flow reuses the first one's temporary Prefect server
MAKE = """
import sys
from flows.cli import app
store = sys.argv[1]
app([*{run}, f"store.url={{store}}"], standalone_mode=False)
app([*{rescore}, "--store", store], standalone_mode=False)
"""


class BrowseRun(NamedTuple):
    store_url: str
    run_id: str
    rescore: str

    @property
    def store(self) -> str:
        return self.store_url


@pytest.fixture(scope="session")
def browse_run(tmp_path_factory: pytest.TempPathFactory) -> BrowseRun:
    """A finished run (``tiny``) and its rescore (``rule``) in a fresh store; ~45 s on 2 cores, made
    once per session: under pytest-xdist the first worker that asks makes it in the session's shared
    temporary folder, the others wait for it and read it (the test files using it may land on
    different workers). ``VERL_FLOW_BROWSE_STORE=DIR``: the store DIR that an earlier session made
    instead (made there when it has no run yet), to iterate on the tests without the pipeline."""
    from filelock import FileLock

    kept = os.environ.get("VERL_FLOW_BROWSE_STORE")
    if kept:
        store = Path(kept)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        store = tmp_path_factory.getbasetemp().parent / "browse-store"  # shared by the session's workers
    else:
        store = tmp_path_factory.mktemp("browse-store")
    with FileLock(str(store) + ".lock"):
        if not (store / "runs" / RUN / "rescore" / RESCORE / "report" / "manifest.json").is_file():
            _make(store)
    return BrowseRun(str(store), RUN, RESCORE)


def _make(store: Path) -> None:
    code = MAKE.format(run=repr(RUN_ARGS), rescore=repr(RESCORE_ARGS))
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(store)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
