"""The run sections: the RL loop and its checkpoints, the artifact store, tracking, export, evaluation,
the sandbox, where stages execute, and the parent run of a fork or replay."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator

from verl_core.config.base import NonNegFloat, NonNegInt, PositiveFloat, PositiveInt, Section, _f


class TrainerConfig(Section):
    project_name: str = _f(
        "verl-flow",
        "Project: the MLflow experiment name (left at this default: $MLFLOW_EXPERIMENT_NAME if set)",
    )
    experiment_name: str = _f("quickstart", "Experiment: prefix of generated run ids, MLflow run name")
    total_iterations: PositiveInt = _f(20, "RL iterations (rollout, reward, update)")
    total_epochs: PositiveInt = _f(100, "Upper bound on passes over the prompt set")
    test_freq: NonNegInt = _f(5, "Validate every this many iterations (0: never)")
    val_before_train: bool = _f(True, "Validate before the first iteration")
    save_freq: NonNegInt = _f(10, "Checkpoint every this many iterations (0: only at the end)")
    critic_warmup: NonNegInt = _f(0, "Iterations that update only the critic before the actor starts")
    max_ckpt_to_keep: PositiveInt = _f(2, "Checkpoints kept (older ones deleted)")
    resume_mode: str = _f("auto", "auto (resume the run if it exists) | disable | an iteration number")
    seed: int = _f(1, "Global seed (torch, python, numpy)")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "Device for model stages (auto: cuda if available)")
    nnodes: PositiveInt = _f(1, "Nodes of the SFT and RL-loop jobs (more than one process: torchrun)")
    n_gpus_per_node: PositiveInt = _f(
        1, "Processes per node, one per GPU (on CPU: processes); nnodes × this is the world size"
    )
    rdzv_endpoint: str | None = _f(
        None, "host:port of the c10d rendezvous of a multi-node job (None: this host, one node)"
    )
    rdzv_id: str = _f(
        "verl-flow", "c10d rendezvous id of multi-node jobs; followers (verl-flow spmd-follow) pass the same"
    )
    refuse_unfit: bool = _f(
        True,
        "verl-flow run refuses, before any work, a run whose planned memory (verl-flow plan) exceeds what "
        "this machine has by more than the plan's error margin (local mode)",
    )
    rollout_ahead: int = _f(
        0,
        "Policy versions a rollout lags the trainer (0: on-policy; 1: rollout i+1 is sampled from policy i "
        "beside update i, an engine with its own weights, one process); ppo_update refuses an older batch",
        ge=0,
        le=1,
    )

    @field_validator("resume_mode")
    @classmethod
    def _resume_mode(cls, v: str) -> str:
        if v in ("auto", "disable") or v.isdigit():
            return v
        raise ValueError("'auto', 'disable' or an iteration number")


class StoreConfig(Section):
    url: str = _f(
        "runs",
        "Artifact store root: a local path or file://, s3://bucket/prefix, or memory:// "
        "(S3 endpoint and credentials come from the environment only)",
    )
    max_attempts: PositiveInt = _f(10, "botocore attempts per S3 request (standard retry mode)")
    outage_budget_s: PositiveFloat = _f(
        300.0,
        "Seconds an unreachable S3 endpoint is waited for (requests retried with backoff) before the run "
        "fails in one line; a rerun resumes",
    )
    lease_ttl_s: PositiveFloat = _f(
        120.0, "Seconds a run's lease outlives its last renewal (a crashed holder on another host)"
    )


class TrackingConfig(Section):
    enabled: bool = _f(
        True, "Log params, metrics, sample tables and plots to each of tracking.backends (false: to none)"
    )
    backends: list[Literal["mlflow", "wandb"]] = _f(
        ["mlflow"],
        "Where tracking.enabled logs, all at once; wandb needs pip install 'verl-flow[wandb]', its API key, "
        "mode and directory come from WANDB_API_KEY, WANDB_MODE, WANDB_DIR only",
    )
    uri: str | None = _f(
        None,
        "MLflow tracking URI (None: $MLFLOW_TRACKING_URI if set, else sqlite mlflow.db beside a local store)",
    )
    wandb_project: str | None = _f(None, "W&B project (None: trainer.project_name)")
    wandb_entity: str | None = _f(None, "W&B entity, a user or team (None: the API key's default)")
    log_samples: NonNegInt = _f(
        8, "Samples per RL iteration (and validation) logged as a table: prompt, response, score, advantage"
    )


# characters MLflow refuses in a registered model's name (mlflow.utils.validation, 3.x)
MODEL_NAME_REFUSED = "/:.%\"'"


class ExportConfig(Section):
    enable: bool = _f(True, "Export the final policy as a merged HF model dir after RL (pipeline stage)")
    register_model: bool = _f(True, "Register the exported model in the MLflow model registry")
    registered_model_name: str | None = _f(
        None,
        "MLflow registered model name (None: '{trainer.project_name}-{trainer.experiment_name}', each "
        "character MLflow refuses in a name, / : . % \" ', as '_')",
    )

    @field_validator("registered_model_name")
    @classmethod
    def _model_name(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or any(c in v for c in MODEL_NAME_REFUSED)):
            raise ValueError("a name MLflow accepts: not blank, none of / : . % \" '")
        return v


class RetrainConfig(Section):
    start_from: Literal["config", "champion"] = _f(
        "config",
        "Initial model of the run: the config's model section, or the registered model's current "
        "champion (its export as model.path, SFT skipped; the config's model when there is no champion "
        "yet); what the run started from is recorded in run.json (origin)",
    )


class EvalConfig(Section):
    enable: bool = _f(True, "Evaluate the exported policy as the pipeline's last stage")
    max_samples: NonNegInt = _f(0, "Evaluate at most this many held-out prompts (0: all)")
    k: PositiveInt = _f(4, "Sampled responses per prompt for pass@k (k=1 skips sampling)")
    temperature: PositiveFloat = _f(1.0, "Temperature of the pass@k samples (the greedy pass uses 0)")
    top_p: float = _f(1.0, "Nucleus sampling mass of the pass@k samples", gt=0, le=1)
    seed: int = _f(1, "Sampling seed of the pass@k samples")
    table_rows: NonNegInt = _f(20, "Sample completions shown in the Prefect/MLflow table artifact")


class SandboxConfig(Section):
    """Where untrusted code runs (the code scorer, the python tool): bubblewrap, see
    verl_core.runtime.sandbox."""

    allow_weak_sandbox: bool = _f(
        False, "Without bwrap, run code in a plain subprocess (rlimits, empty env; no network/file isolation)"
    )
    timeout_s: PositiveFloat = _f(5.0, "Wall-clock seconds of one run, then its processes are killed")
    cpu_time_s: PositiveInt = _f(5, "CPU seconds of one run (RLIMIT_CPU)")
    memory_mb: PositiveInt = _f(512, "Address space of each sandboxed process in MiB (RLIMIT_AS)")
    max_processes: PositiveInt = _f(32, "Processes one run may add (RLIMIT_NPROC over the user's count)")
    max_output_bytes: PositiveInt = _f(16384, "Bytes of stdout and of stderr kept; more stops the run")
    max_file_mb: PositiveInt = _f(16, "Largest file the code may write, and the size of its /tmp, in MiB")


class ExecutionConfig(Section):
    mode: Literal["local", "deployments"] = _f(
        "local", "local: one process, no server; deployments: GPU stages on the gpu work pool"
    )
    shared_filesystem: bool = _f(
        False,
        "deployments: local paths (a file:// store, a sqlite tracking URI) are on a filesystem every "
        "worker mounts at the same path",
    )
    sft_deployment: str = _f(
        "sft-warmup/sft-stage", "deployments: the SFT warm-up flow's deployment (flow/name)"
    )
    rl_deployment: str = _f("rl-loop/rl-loop-stage", "deployments: the RL loop flow's deployment (flow/name)")
    export_deployment: str = _f(
        "export-model/export-stage", "deployments: the export flow's deployment (flow/name)"
    )
    poll_interval_s: PositiveFloat = _f(5.0, "deployments: seconds between checks of a dispatched flow run")
    lost_after_s: PositiveFloat = _f(
        120.0,
        "deployments: a dispatched stage flow run whose heartbeat (its stage lease in the store, renewed "
        "every lost_after_s/3) stood still this long is lost (its worker preempted): marked Crashed and "
        "dispatched again",
    )
    start_timeout_s: PositiveFloat = _f(
        600.0,
        "deployments: a stage flow run taken by a worker that has not started its heartbeat this long after "
        "(process start, imports, environment check) is lost too",
    )
    redispatch_retries: NonNegInt = _f(
        2,
        "deployments: times a lost or crashed stage flow run is dispatched again (resuming from its "
        "checkpoint)",
    )
    redispatch_timeout_s: PositiveFloat = _f(
        600.0,
        "deployments: fail when a dispatched stage flow run has waited this long for a worker while no "
        "worker of its pool is online",
    )
    api_outage_s: PositiveFloat = _f(
        300.0, "deployments: fail when the Prefect API has not answered the dispatcher for this long"
    )
    task_retries: NonNegInt = _f(2, "Prefect retries of I/O-bound stage tasks")
    retry_delay_s: NonNegFloat = _f(5.0, "Seconds between task retries")
    stall_timeout_s: NonNegFloat = _f(
        1800.0, "Fail a compute stage (or collective) with no progress for this many seconds (0: never)"
    )


class ParentConfig(Section):
    """The run this one branches from (``verl-flow run CONFIG --fork RUN@ITER``, ``verl-flow replay``):
    the parent's committed checkpoint ``ckpt/iter-ITER`` in the same store is the starting state."""

    run_id: str = _f(..., "The parent run's id (in this run's store)")
    iteration: PositiveInt = _f(..., "Start from the parent's checkpoint after this many updates")
    replay: bool = _f(
        False,
        "Train on the parent's stored rollouts and rewards of iterations iteration.. instead of sampling "
        "(verl-flow replay)",
    )
    rewards: str | None = _f(
        None, "replay: the rewards of the parent's rescore of this name (None: the parent's own rewards)"
    )


# Where and how models are placed, not what they compute: left out of the identity of a policy's
# trajectory (a run resumes on another world size or strategy) and of the update stage's inputs.
PLACEMENT_FIELDS: dict[str, set[str]] = {
    "actor": {"strategy", "zero_stage", "param_offload", "tensor_parallel_size"},
    "critic": {"strategy", "zero_stage", "param_offload"},
    "ref": {"strategy", "param_offload"},
    "rollout": {"share_weights"},
}
