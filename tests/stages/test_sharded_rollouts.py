"""A rollout sharded over 2 gloo ranks samples exactly the tokens of the same rollout in one process:
each engine generates its share of the prompts (other batch shapes than one process), every sample
seeded by (seed, prompt, sample); an engine spanning both ranks is held and run by rank 0 alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stages import sharded_rollout_worker as worker

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_ranks_sample_the_tokens_of_one_process(tmp_path: Path) -> None:
    out = tmp_path / "sharded.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, worker.__file__, str(out)], capture_output=True, text=True, timeout=180, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = worker.rollouts()
    assert len(single) == 7 * 3
    assert len({tuple(r[2]) for r in single}) > 7  # samples of one prompt differ: it does sample
    for r in range(2):
        # one engine per rank, and one engine of 2 ranks held by rank 0 alone (rank 1: a group
        # member, which generates nothing): every rank gets all the rollouts of one process
        for mode, sharded in json.loads(Path(f"{out}.{r}").read_text()).items():
            assert [x[:3] for x in sharded] == [x[:3] for x in single], (r, mode)  # prompt, sample, ids
            for (*_, lp_a), (*_, lp_b) in zip(sharded, single, strict=True):
                assert lp_a == pytest.approx(lp_b, abs=1e-5)


def test_one_process_with_a_tensor_parallel_engine_generates_everything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # eval and one-process loops hold one engine whatever its tensor_parallel_size: 1 process // tp 2
    # would be 0 engines; it is one engine generating every prompt, unsharded
    import stages.floor.rollouts as rollouts

    seen: list[tuple[int, object]] = []

    def generate(engine, tokenizer, prompt_ids, *args, prompt_keys=None, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((len(prompt_ids), prompt_keys))
        return rollouts.Rollouts([], None, {})

    class TensorParallelEngine:
        tensor_parallel_size = 2

    monkeypatch.setattr(rollouts, "generate_rollouts", generate)
    ids = [[1, 2], [3], [4, 5, 6]]
    rollouts.sharded_rollouts(TensorParallelEngine(), None, ids, None, None, 8)  # type: ignore[arg-type]
    assert seen == [(3, None)]  # all 3 prompts, no shard keys
