"""Determinism under load: the same config run N times in a row, each in a fresh store beside
``--load`` busy processes, every run's final policy sha256 and artifact fingerprint printed; exits 1
unless all runs agree (the contract: same config, seed, code and machine type → same run).

    .venv/bin/python benchmarks/determinism.py --runs 5 --load 1     # the quickstart, 20 iterations
    .venv/bin/python benchmarks/determinism.py --config configs/quickstart_grpo.yaml --runs 3
    .venv/bin/python benchmarks/determinism.py --runs 1 --load 0 --save before.json \
        trainer.total_iterations=4          # a refactor's check: diff the saved fingerprints after

The fingerprint is :func:`stages.floor.fingerprint.fingerprint` (every committed file by sha256,
per-process values left out), digested to one line per run. Runs in ``make quickstart``'s environment
(no pytest needed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stages.floor.fingerprint import fingerprint  # noqa: E402
from verl_core.store import ArtifactStore  # noqa: E402


def _final_weights_sha(store_url: str, run_id: str) -> str:
    """``ckpt/iter-N policy <sha256> [critic <sha256>]`` of the run's last checkpoint."""
    store = ArtifactStore(store_url)
    ckpts = sorted(m.stage for m in store.list_manifests(run_id) if m.stage.startswith("ckpt/"))
    m = store.committed(run_id, ckpts[-1])
    assert m is not None
    names = {f.name for f in m.files}
    shas = [
        f"{part} {hashlib.sha256(store.read_bytes(m, f'{part}/model.safetensors')).hexdigest()}"
        for part in ("policy", "critic")
        if f"{part}/model.safetensors" in names
    ]
    return " ".join([ckpts[-1], *shas])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/quickstart.yaml")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--load", type=int, default=1, help="busy-loop processes beside each run")
    parser.add_argument(
        "--save", type=Path, help="write run 0's fingerprint here (JSON), to diff against a later one"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="verl-flow-determinism-") as tmp:
            for i in range(args.runs):
                store_url = str(Path(tmp) / f"run-{i}")
                cmd = [sys.executable, "-m", "flows.cli", "run", args.config, f"store.url={store_url}"]
                cmd += ["tracking.enabled=false", *args.overrides, "--run-id", "det"]
                t0 = time.perf_counter()
                done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
                seconds = time.perf_counter() - t0
                if done.returncode != 0:
                    print(f"run {i}: failed\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                    return 1
                prints = fingerprint(store_url, "det")
                digest = hashlib.sha256(json.dumps(prints, sort_keys=True).encode()).hexdigest()
                policy = _final_weights_sha(store_url, "det")
                results.append((policy, digest, prints))
                if i == 0 and args.save:
                    args.save.write_text(json.dumps(prints, sort_keys=True, indent=1))
                print(f"run {i}: {seconds:.0f} s  {policy}  fingerprint {digest[:16]}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    same = len({(p, d) for p, d, _ in results}) == 1
    if not same:
        first = results[0][2]
        for i, (_, _, prints) in enumerate(results[1:], 1):
            diff = sorted(k for k in first.keys() | prints.keys() if first.get(k) != prints.get(k))
            print(f"run {i} differs from run 0 in {len(diff)} files: {diff[:8]}")
    print(f"{args.runs} runs, load {args.load}: {'one' if same else 'SEVERAL'} result(s)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
