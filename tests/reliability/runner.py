"""``python -m tests.reliability.runner [--kill-at | --pause-at | --full-at POINT] -- <verl-flow args>``

Runs the real ``verl-flow`` CLI in this process; with ``--kill-at`` the process SIGKILLs itself (no
cleanup, no ``finally``, exactly ``kill -9``) at one named point of the commit protocol; with
``--pause-at`` it stops there (holding its run lease) until someone else kills it, or, with
``$RELIABILITY_RELEASE`` set, until that file exists (then it goes on); with ``--full-at``
the disk is full from that point on: the ``fsync`` of every later local store write fails with
``ENOSPC`` after its bytes went to the temporary file (as a full disk with delayed allocation does).
Production code has no fault hooks: the points are installed here by wrapping the store's write
methods. At the point it prints ``KILLED-AT <point>`` / ``PAUSED-AT <point>`` (and creates the file named by
``$RELIABILITY_MARKER``, if set), so the test can tell the intended kill from a crash.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from verl_core.store import store as store_mod


class KillPoint(NamedTuple):
    """Die when ``method`` is called for a stage matching ``stage`` (and, for file writes, an
    artifact whose name matches ``name``); ``torn``: first write half of the file's bytes in place,
    non-atomically."""

    method: str  # "_put" (a data file), "publish" (a manifest)
    stage: str  # regex on the stage name
    name: str | None = None
    torn: bool = False
    what: str = ""
    skip: int = 0  # matches to let through first (the point is the skip+1-th)


KILL_POINTS = {
    "preprocess-writes": KillPoint(
        "_put", r"^preprocess$", r"sft/train\.parquet", what="after the prompt tables, before the SFT tables"
    ),
    "rollout-mid-artifact": KillPoint(
        "_put",
        r"^iter-0000/rollout$",
        r"rollouts\.parquet",
        torn=True,
        what="half of rollouts.parquet written",
    ),
    "before-manifest": KillPoint(
        "publish", r"^iter-0001/reward$", what="every data file of the stage written, manifest not"
    ),
    "checkpoint-save": KillPoint(
        "_put", r"^ckpt/iter-0002$", r"trainer_state\.pt", what="policy and critic written, trainer state not"
    ),
    "checkpoint-save-5": KillPoint(
        "_put",
        r"^ckpt/iter-0005$",
        r"trainer_state\.pt",
        what="ckpt/iter-0005: policy written, trainer state not",
    ),
    "pending-publish": KillPoint(
        "publish", r"^iter-0000/update$", what="checkpoint committed, the updates it covers not yet"
    ),
    "sft-second-checkpoint": KillPoint(
        "publish", r"^sft-ckpt$", skip=1, what="SFT: its first checkpoint committed, the second not"
    ),
    "export": KillPoint(
        "_put", r"^export/", r".*model\.safetensors$", what="export: config files written, weights not"
    ),
    "rescore-second-iteration": KillPoint(
        "publish",
        r"^rescore/[^/]+/iter-0001/reward$",
        what="rescore: iteration 0 rescored, iteration 1's rewards written, its manifest not",
    ),
}


def _stop(point: str, pause: bool) -> None:
    print(f"{'PAUSED' if pause else 'KILLED'}-AT {point}", flush=True)
    sys.stderr.flush()
    marker = os.environ.get("RELIABILITY_MARKER")
    if marker:
        with open(marker, "w") as f:
            f.write(point)
    if pause:  # hold everything (the run lease included) until killed, or until $RELIABILITY_RELEASE exists
        release = os.environ.get("RELIABILITY_RELEASE")
        while not (release and os.path.exists(release)):
            time.sleep(0.2 if release else 3600)
        return
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, pause: bool = False) -> None:
    kp = KILL_POINTS[point]
    stage_re = re.compile(kp.stage)
    seen = [0]

    def _at_point() -> bool:
        seen[0] += 1
        return seen[0] > kp.skip

    if kp.method == "_put":
        real_put: Callable[..., Any] = store_mod.StageWriter._put

        def put(self: store_mod.StageWriter, name: str, data: bytes, *args: Any, **kw: Any) -> Any:
            if (
                stage_re.match(self.stage)
                and (kp.name is None or re.fullmatch(kp.name, name))
                and _at_point()
            ):
                if kp.torn:
                    path = posixpath.join(self._stage_dir(), self.attempt, name)
                    self.store.fs.makedirs(posixpath.dirname(path), exist_ok=True)
                    self.store.fs.pipe_file(path, data[: len(data) // 2])
                _stop(point, pause)
            return real_put(self, name, data, *args, **kw)

        store_mod.StageWriter._put = put  # type: ignore[method-assign]
    else:
        real_publish: Callable[..., Any] = store_mod.ArtifactStore.publish

        def publish(self: store_mod.ArtifactStore, manifest: Any) -> Any:
            if stage_re.match(manifest.stage) and _at_point():
                _stop(point, pause)
            return real_publish(self, manifest)

        store_mod.ArtifactStore.publish = publish  # type: ignore[method-assign]


def install_full(point: str) -> None:
    kp = KILL_POINTS[point]
    assert kp.method == "_put", f"{point}: --full-at needs a file-write point"
    stage_re = re.compile(kp.stage)
    real_put: Callable[..., Any] = store_mod.StageWriter._put
    real_fsync = os.fsync
    full = [False]

    def put(self: store_mod.StageWriter, name: str, data: bytes, *args: Any, **kw: Any) -> Any:
        if stage_re.match(self.stage) and (kp.name is None or re.fullmatch(kp.name, name)):
            if not full[0]:
                print(f"FULL-AT {point}", flush=True)
            full[0] = True
        return real_put(self, name, data, *args, **kw)

    def fsync(fd: int) -> None:
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    store_mod.StageWriter._put = put  # type: ignore[method-assign]
    os.fsync = fsync


def main(argv: list[str]) -> None:
    if argv[:1] in (["--kill-at"], ["--pause-at"]):
        install(argv[1], pause=argv[0] == "--pause-at")
        argv = argv[2:]
    elif argv[:1] == ["--full-at"]:
        install_full(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    from flows.cli import main as cli

    sys.argv = ["verl-flow", *argv]
    cli()


if __name__ == "__main__":
    main(sys.argv[1:])
