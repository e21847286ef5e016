"""The SPMD object collectives: the identity in one process; with 2 gloo ranks, rank 0 decides, its
failure reaches every rank instead of leaving them waiting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.verl_core.runtime import ranks_worker
from verl_core.runtime import ranks

REPO = Path(__file__).resolve().parents[3]


def test_one_process_is_the_identity() -> None:
    assert (ranks.rank(), ranks.world_size(), ranks.is_main()) == (0, 1, True)
    assert (ranks.local_rank(), ranks.local_world_size()) == (0, 1)
    assert ranks.broadcast_from_main("x") == "x"
    assert ranks.gather_to_main([1, 2]) == [1, 2]
    assert ranks.all_gather([3]) == [3]
    assert ranks.on_main(lambda: 4) == 4
    with pytest.raises(ZeroDivisionError):
        ranks.on_main(lambda: 1 / 0)


@pytest.mark.slow
def test_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, ranks_worker.__file__, str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    assert (r0["world"], r0["main"], r1["main"]) == (2, True, False)
    assert (r0["local"], r1["local"]) == ([0, 2], [1, 2])  # one node: local = global
    assert r0["decided"] == r1["decided"] == "decided by 0"
    assert r0["gathered"] == ["0a", "0b", "1a", "1b"] and r1["gathered"] is None  # rank order
    assert r0["all"] == r1["all"] == [0, 10]
    assert r0["on_main"] == r1["on_main"] == "ran on 0"
    assert r0["failed"] == "ZeroDivisionError: division by zero"
    assert r1["failed"] == "RankFailedError: rank 0 failed: ZeroDivisionError: division by zero"
