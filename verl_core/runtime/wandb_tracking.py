"""Weights & Biases tracking (``tracking.backends`` [..., "wandb"], ``pip install 'verl-flow[wandb]'``):
the same metrics, params, sample tables and files as :class:`~verl_core.runtime.tracking.MlflowTracker`.

One W&B run per verl-flow run. Its id is derived from the store and the run id
(:func:`wandb_run_id`), so a rerun of the run id resumes the same W&B run and a stage in another
process (deployments mode, ``verl-flow eval``) attaches to it by the id the
:class:`~verl_core.runtime.run.RunContext` carries, as it does to the MLflow run. Within a process the run is
initialised once and shared by every tracker of that id.

The API key, mode (``online`` / ``offline``) and local directory come from the environment only
(``WANDB_API_KEY``, ``WANDB_MODE``, ``WANDB_DIR``): this module never reads or passes them, and the
params are the flattened config with secrets redacted.

W&B wants one increasing step per run, while verl-flow steps restart (SFT steps, then RL iterations
from 0): every metric is plotted against the logged ``verl_flow/step`` instead (``define_metric``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_core.errors import ConfigError
from verl_core.runtime.tracking import Columns

STEP_KEY = "verl_flow/step"
_runs: dict[str, Any] = {}  # W&B run id → the live wandb Run of this process
_lock = threading.Lock()


def require_wandb() -> None:
    """One line naming the fix when the config asks for W&B and the package is missing."""
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "tracking.backends: 'wandb' needs the wandb package, which is not installed "
            "(pip install 'verl-flow[wandb]')"
        )


def wandb_run_id(store_url: str, run_id: str) -> str:
    """The W&B run id of verl-flow run ``run_id`` in the store at ``store_url`` (16 hex digits: W&B
    ids must be unique per project and may not hold '/', ':' and other characters run ids may)."""
    return hashlib.sha256(f"{store_url}\0{run_id}".encode()).hexdigest()[:16]


class WandbTracker:
    """Logs to one W&B run, initialised (or resumed) on first use in this process."""

    def __init__(self, run_id: str, project: str, name: str, entity: str | None = None) -> None:
        self.run_id, self.project, self.name, self.entity = run_id, project, name, entity

    @classmethod
    def start(
        cls, run_id: str, project: str, name: str, entity: str | None, params: Mapping[str, str]
    ) -> WandbTracker:
        """Create or resume the W&B run ``run_id`` and log ``params`` as its config."""
        tracker = cls(run_id, project, name, entity)
        tracker.run.config.update(dict(params), allow_val_change=True)
        return tracker

    @property
    def run(self) -> Any:
        require_wandb()
        import wandb

        with _lock:
            run = _runs.get(self.run_id)
            if run is None:
                run = wandb.init(
                    id=self.run_id,
                    project=self.project,
                    entity=self.entity,
                    name=self.name,
                    resume="allow",
                    reinit="create_new",
                    settings=wandb.Settings(console="off", silent=True),
                )
                run.define_metric(STEP_KEY)
                run.define_metric("*", step_metric=STEP_KEY)
                _runs[self.run_id] = run
        return run

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log finite metrics at ``step`` (non-finite values are skipped, as MLflow's are)."""
        finite = {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self.run.log({**finite, STEP_KEY: step})

    def log_table(self, data: Columns, artifact_file: str) -> None:
        """A ``wandb.Table`` under the key ``artifact_file`` without its extension."""
        import wandb

        names = list(data)
        rows = [list(r) for r in zip(*(data[c] for c in names), strict=True)]
        columns: list[str | int] = [*names]  # wandb's annotation
        self.run.log({_key(artifact_file): wandb.Table(columns=columns, data=rows)})

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        import json

        self.log_text(json.dumps(obj, indent=2, sort_keys=True, default=str), artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        path = Path(self.run.dir) / artifact_file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.run.save(str(path), base_path=self.run.dir, policy="now")

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """The file among the run's files, under ``artifact_path`` (the plots: ``plots/*.png``)."""
        dest = Path(self.run.dir) / (artifact_path or "") / Path(local_path).name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local_path, dest)
        self.run.save(str(dest), base_path=self.run.dir, policy="now")

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """W&B tags are bare labels: key/value tags go into the run's config."""
        self.run.config.update({k: str(v) for k, v in tags.items()}, allow_val_change=True)

    def end(self, status: str = "FINISHED") -> None:
        """Finish the run (exit code 0 for FINISHED, else 1); a later use resumes it."""
        with _lock:
            run = _runs.pop(self.run_id, None)
        if run is not None:
            run.finish(exit_code=0 if status == "FINISHED" else 1)


def _key(artifact_file: str) -> str:
    """``samples/train/iter-0003.json`` → ``samples/train/iter-0003``."""
    return artifact_file.rsplit(".", 1)[0] if "." in Path(artifact_file).name else artifact_file
