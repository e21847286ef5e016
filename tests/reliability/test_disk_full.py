"""A full disk under a local store: from the final checkpoint's trainer state on (its policy and critic
already written), every store write fails with ENOSPC (``runner.py --full-at``). The run fails with
one line naming the store, the file and what to do; the checkpoint is not committed, no temporary
copy is left holding space, every committed artifact still matches its manifest; the rerun (space
freed) resumes without redoing a committed stage and ends exactly as an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

from tests.reliability.conftest import Pipeline, Reference, attempts, fingerprint
from verl_core.store import ArtifactStore

RUN = "full"


def test_a_full_disk_fails_in_one_line_and_the_rerun_resumes(
    pipeline: Pipeline, reference: Reference, tmp_path: Path
) -> None:
    store_url = str(tmp_path / "store")
    r = pipeline.run(store_url, RUN, full_at="checkpoint-save")
    assert r.returncode == 1 and "FULL-AT checkpoint-save" in r.output, r.output[-4000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-4000:]
    line = errors[0]
    assert line.startswith("error: stage checkpoint, iteration 2: "), line
    assert f"store file://{store_url}: no space left on the device writing runs/{RUN}/ckpt/iter-0002/" in line
    assert "free space and rerun to resume" in line and "Traceback" not in r.stderr

    store = ArtifactStore(store_url)
    assert store.committed(RUN, "ckpt/iter-0002") is None
    assert not [p for p in store.fs.find(store.path("runs", RUN)) if ".tmp-" in p]
    before = attempts(store_url, RUN)
    assert "iter-0001/reward" in before  # the iterations' stages were committed before the disk filled
    fingerprint(store_url, RUN)  # every committed file still matches its manifest

    again = pipeline.run(store_url, RUN)
    assert again.returncode == 0, again.output[-4000:]
    after = attempts(store_url, RUN)
    assert {s: after[s] for s in before} == before  # nothing committed was redone
    assert fingerprint(store_url, RUN) == reference.fingerprint
