"""A run's fingerprint: every committed artifact by digest, the values that legitimately differ
between two processes left out, so that two runs of the same config, seed, code and machine type
compare equal (the determinism contract; ``tests/reliability`` and ``benchmarks/determinism.py`` hold
runs to it). It knows which stage files carry per-process values (wall-clock series, Python's RNG
state, the model card's links): the stages that write them stand on this floor."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from verl_core.models.checkpoint import load_state_bytes
from verl_core.store import ArtifactStore, Manifest


def fingerprint(store_url: str, run_id: str) -> dict[str, str]:
    """``{"stage/file": digest}`` of every committed artifact, each read back and checked against its
    manifest. The digest is the file's sha256, except for three kinds of file that legitimately hold
    a per-process value; for those it is the sha256 of their content without that value:

    * ``*.pt`` trainer states: the tensors, numbers and torch RNG, without ``rng.python*``: Python's
      ``random`` state, which nothing in training draws from and no stage seeds, so it differs between
      any two processes; and an SFT state's ``history`` without its ``perf/*`` rows;
    * ``sft/metrics.parquet``: without the ``perf/*`` rows (tokens per second);
    * ``ckpt/*/pending/*.json``: a sealed manifest: its stage and its files' sha256, without the
      producer's pid and time and the input key (a hash of input manifests, which hold the same);
    * ``report/metrics.json``: without the wall-clock series (``stage_seconds``, ``iteration_s``,
      ``timing_s/*``, ``perf/*``); ``report/report.md`` and ``report/plots/timing.png`` render those
      and are left out, and so is an export's model card (``model/README.md``), which names the
      store's manifest URIs and the MLflow run and model version.
    """
    store = ArtifactStore(store_url)
    out = {}
    for m in store.list_manifests(run_id):
        for f in m.files:
            data = store.read_bytes(m, f.name)  # raises ArtifactCorruptError on a mismatch
            key = f"{m.stage}/{f.name}"
            if f.name.endswith(".pt"):
                out[key] = _digest(_without_process_values(load_state_bytes(data, key)))
            elif m.stage == "sft" and f.name == "metrics.parquet":
                rows = pq.read_table(pa.BufferReader(data)).to_pylist()
                out[key] = _digest([r for r in rows if not str(r["name"]).startswith("perf/")])
            elif key in WALL_CLOCK_RENDERINGS:
                continue
            elif m.stage.startswith("export/") and f.name == "model/README.md":
                continue  # the model card names the store's URIs and the MLflow run and version
            elif key == "report/metrics.json":
                series = json.loads(data)["series"]
                out[key] = _digest({k: v for k, v in series.items() if not _wall_clock(k)})
            elif "/pending/" in f"/{f.name}":
                sealed = Manifest.from_bytes(data, key)
                out[key] = _digest([sealed.stage, [(e.name, e.sha256) for e in sealed.files]])
            else:
                out[key] = f.sha256
    return out


WALL_CLOCK_RENDERINGS = {"report/report.md", "report/plots/timing.png"}


def _wall_clock(metric: str) -> bool:
    return metric == "iteration_s" or metric.startswith(("timing_s/", "perf/"))


def _without_process_values(state: dict[str, Any]) -> dict[str, Any]:
    rng = {k: v for k, v in state.get("rng", {}).items() if not k.startswith("python")}
    out = {**state, "rng": rng}
    if "history" in state:  # an SFT trainer state: its (step, metric, value) rows, tokens per second left out
        out["history"] = [row for row in state["history"] if not str(row[1]).startswith("perf/")]
    return out


def _digest(obj: Any) -> str:
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"tensor{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(f"key:{k}".encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"seq{len(x)}".encode())
            for v in x:
                feed(v)
        else:
            h.update(f"{type(x).__name__}:{x!r}".encode())

    feed(obj)
    return h.hexdigest()
