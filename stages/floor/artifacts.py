"""Artifacts more than one stage reads or writes, and their readers.

Policy checkpoints: a set of files under a prefix of a stage's output: ``{prefix}/...`` an HF model
dir (safetensors + config + tokenizer) for full fine-tuning, or a PEFT adapter dir for LoRA, in which
case a model built from scratch also has its frozen base under ``{prefix}-base/`` (a pretrained base
is reloaded from ``model.path``). Written by sft and the RL checkpoints, read by the RL loop, export
and eval.

Also: the run's tokenizer (written by template_pack under ``tokenizer/``), export model dirs (written
by export under ``model/``, copied out by :func:`copy_export`), which policy stage a run has for an
iteration, what an eval evaluates (:class:`EvalSource`), the rollouts table (kind "rollouts") with
the deterministic prompt batches it is sampled from, and what the update reads of an iteration (its
rollouts and rewards, the kept rows of every generation batch under dynamic sampling; stale rollouts
refused) and writes (its per-sample table, kind "update").
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from torch import Tensor, nn

from stages.floor.initial_model import model_dir
from stages.floor.locations import SFT, ckpt_stage, eval_label, export_stage, list_checkpoints
from stages.floor.policy import quant_spec
from verl_core.config import ModelConfig
from verl_core.data import load_tokenizer_from_bytes
from verl_core.errors import ArtifactNotFoundError, ConfigError, DataError
from verl_core.files import write_files
from verl_core.models.checkpoint import saved_model
from verl_core.models.loading import apply_liger, enable_gradient_checkpointing, load_causal_lm, unwrap
from verl_core.rollout import Completion
from verl_core.rollout.multi_turn import Trajectory, turns_to_rows
from verl_core.store import ArtifactStore, Manifest, StageWriter, storage_options
from verl_core.store.schemas import EXTRA_INFO, TOKEN_MASK, TURNS

if TYPE_CHECKING:
    from verl_core.training.batch import RolloutBatch

TOKENIZER_PREFIX = "tokenizer/"  # template_pack's tokenizer files
MODEL_PREFIX = "model"  # an export's HF model dir

# --------------------------------------------------------------------------------------------------
# Policy checkpoints


def write_policy(
    stage: StageWriter,
    prefix: str,
    lm: nn.Module,
    tokenizer: Any,
    model: ModelConfig,
    *,
    state_dict: Mapping[str, Tensor] | None = None,
) -> None:
    """Write a policy checkpoint under ``prefix`` (see the module docstring). ``state_dict``: the full
    weights of a sharded ``lm`` (gathered by its strategy; None: ``lm``'s own)."""
    # the files go to the store from save_pretrained's folder, never as bytes (2 GB at 0.5B)
    with saved_model(lm, tokenizer, state_dict=state_dict) as files:
        for name, path in files.items():
            stage.write_bytes(f"{prefix}/{name}", path)
    if model.lora_rank > 0 and model.init == "scratch":
        with saved_model(_plain_base(lm), None) as files:
            for name, path in files.items():
                stage.write_bytes(f"{prefix}-base/{name}", path)


def _plain_base(lm: nn.Module) -> nn.Module:
    """The frozen base of a PEFT model as a plain HF model. ``get_base_model()`` still holds the
    injected LoRA layers, whose weights are named ``...base_layer.weight``: saved as is, they would
    not load back into the architecture (the base would be silently re-initialised)."""
    from transformers import AutoModelForCausalLM

    base = unwrap(lm)
    weights = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if "lora_" not in k}
    plain = AutoModelForCausalLM.from_config(base.config, dtype=base.dtype)
    plain.load_state_dict(weights, strict=True)
    return plain


def read_policy(
    store: ArtifactStore, manifest: Manifest, prefix: str, model: ModelConfig, *, for_training: bool = True
) -> nn.Module:
    """Load a policy checkpoint written by :func:`write_policy` (trainable LoRA adapters included).
    ``for_training``: set up as :func:`~stages.floor.policy.build_policy` sets up a new one (a QLoRA
    base quantized again and prepared for k-bit training, gradient checkpointing when configured);
    False: for merging and evaluation, the base in ``model.dtype`` without quantization."""
    from peft import PeftModel, prepare_model_for_kbit_training

    with ExitStack() as dirs:
        policy_dir = dirs.enter_context(local_model_dir(store, manifest, prefix))
        if model.lora_rank == 0:
            lm = load_causal_lm(
                str(policy_dir),
                dtype=model.dtype,
                attn_implementation=model.attn_implementation,
                trust_remote_code=model.trust_remote_code,
            )
        else:
            if model.init == "scratch":
                base_path = str(dirs.enter_context(local_model_dir(store, manifest, f"{prefix}-base")))
            else:
                assert model.path is not None
                base_path = model_dir(model.path)  # a store URI: this process's copy
            quant = quant_spec(model) if for_training else None
            base = load_causal_lm(
                base_path,
                dtype=model.dtype,
                attn_implementation=model.attn_implementation,
                trust_remote_code=model.trust_remote_code,
                quantization=quant,
            )
            if quant is not None:
                base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
            lm = PeftModel.from_pretrained(base, str(policy_dir), is_trainable=True)
    if for_training and model.use_liger:
        apply_liger(lm)
    if for_training and model.gradient_checkpointing:
        enable_gradient_checkpointing(lm)
    return lm


def files_under(store: ArtifactStore, manifest: Manifest, prefix: str) -> dict[str, bytes]:
    """``{name: bytes}`` of a committed stage's files under ``prefix/`` (a model or tokenizer dir)."""
    start = prefix.rstrip("/") + "/"
    return {
        f.name[len(start) :]: store.read_bytes(manifest, f.name)
        for f in manifest.files
        if f.name.startswith(start)
    }


@contextmanager
def local_model_dir(store: ArtifactStore, manifest: Manifest, prefix: str) -> Iterator[Path]:
    """A directory of a committed stage's files under ``prefix/`` (a model dir) for loaders that take
    a path, no file read into memory (a 2 GB policy at 0.5B, a critic beside it): links to the store's
    own files on a local store, downloads elsewhere, each checked against the manifest
    (:meth:`ArtifactStore.local_file`); removed on exit."""
    start = prefix.rstrip("/") + "/"
    names = [f.name for f in manifest.files if f.name.startswith(start)]
    if not names:
        raise ConfigError(
            f"stage {manifest.stage!r} of run {manifest.run_id!r} has no checkpoint under {prefix}/"
        )
    with ExitStack() as files, tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rel = name[len(start) :]
            if "/" in rel or rel.startswith("."):
                raise DataError(f"{store.file_uri(manifest, name)}: expected a plain file name under {start}")
            local = files.enter_context(store.local_file(manifest, name))
            (Path(tmp) / rel).symlink_to(local.resolve())
        yield Path(tmp)


# --------------------------------------------------------------------------------------------------
# Tokenizer and exports


def load_tokenizer(store: ArtifactStore, template_pack_uri: str) -> Any:
    """The tokenizer template_pack wrote (same ids as when it was trained), chat template set."""
    files = files_under(store, store.read_manifest(template_pack_uri), TOKENIZER_PREFIX)
    if not files:
        raise DataError(f"{template_pack_uri}: the stage wrote no tokenizer files")
    return load_tokenizer_from_bytes(files)


def materialise_export(store: ArtifactStore, manifest: Manifest, directory: str | Path) -> Path:
    """Write a committed export's model files into ``directory`` (for loading with transformers)."""
    return write_files(files_under(store, manifest, MODEL_PREFIX), directory)


def copy_export(store: ArtifactStore, manifest: Manifest, dest: str) -> str:
    """Copy a committed export's model dir to ``dest`` (a local directory or an fsspec URL); returns
    the destination. A local destination appears complete or not at all (written beside, renamed)."""
    names = [f.name for f in manifest.files if f.name.startswith(MODEL_PREFIX + "/")]
    if "://" in dest and not dest.startswith("file://"):
        import fsspec

        fs, root = fsspec.core.url_to_fs(dest, **storage_options(dest))
        if fs.exists(posixpath.join(root, "config.json")):
            raise ConfigError(f"--to: {dest} already holds a model (config.json); choose another place")
        # config.json last: a reader that waits for it never sees a partial model
        for name in sorted(names, key=lambda n: n.endswith("/config.json")):
            rel = name[len(MODEL_PREFIX) + 1 :]
            fs.pipe_file(posixpath.join(root, rel), store.read_bytes(manifest, name))
        return dest
    target = Path(re.sub(r"^file://", "", dest)).expanduser().resolve()
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"--to: {target} exists and is not empty; choose a new directory")
    partial = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir(parents=True)
    try:
        for name in names:
            (partial / name[len(MODEL_PREFIX) + 1 :]).write_bytes(store.read_bytes(manifest, name))
        if target.exists():
            target.rmdir()
        os.replace(partial, target)
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    return str(target)


@dataclass(frozen=True)
class PolicySource:
    """A committed policy of a run: a checkpoint stage (``iteration`` = its RL iteration) or the SFT
    policy (``iteration`` = 0, before any RL update)."""

    stage: str
    iteration: int
    manifest_uri: str


def resolve_source(store: ArtifactStore, run_id: str, iteration: int | None) -> PolicySource:
    """The checkpoint of ``iteration`` (None: the latest; 0 without a checkpoint at 0: the SFT
    policy). A clear error lists what the run has."""
    available = list_checkpoints(store, run_id)
    wanted = iteration if iteration is not None else (available[-1] if available else None)
    if wanted is not None and wanted in available:
        return PolicySource(ckpt_stage(wanted), wanted, store.manifest_uri(run_id, ckpt_stage(wanted)))
    if wanted in (None, 0) and store.committed(run_id, SFT) is not None:
        return PolicySource(SFT, 0, store.manifest_uri(run_id, SFT))
    have = ", ".join(map(str, available)) or "none"
    raise ArtifactNotFoundError(
        f"--iteration: run {run_id!r} has no policy checkpoint at iteration {wanted} "
        f"(checkpoints: {have}; the SFT policy is exported with --iteration 0)"
    )


def latest_export(store: ArtifactStore, run_id: str) -> str | None:
    """Manifest URI of the export of the run's latest policy (what export makes when given no
    iteration), or None while it is not committed."""
    stage = export_stage(resolve_source(store, run_id, None).stage)
    return store.manifest_uri(run_id, stage) if store.committed(run_id, stage) is not None else None


@dataclass(frozen=True)
class EvalSource:
    """What an eval evaluates: a committed stage of the run (an export or a checkpoint), a directory,
    or an OpenAI-compatible server (``endpoint``: its base URL; ``served_model``: None, its first)."""

    label: str  # the eval stage is eval/{label}
    manifest_uri: str | None = None
    model_dir: str | None = None
    endpoint: str | None = None
    served_model: str | None = None


def in_run_source(store: ArtifactStore, run_id: str, iteration: int | None) -> EvalSource:
    """The run's checkpoint of ``iteration`` (None: the latest; 0: the SFT policy when there is no
    checkpoint at 0)."""
    s = resolve_source(store, run_id, iteration)
    return EvalSource(eval_label(s.stage), manifest_uri=s.manifest_uri)


def export_source(store: ArtifactStore, export_uri: str) -> EvalSource:
    """The committed export (or checkpoint) at ``export_uri``, named after its stage."""
    stage = store.read_manifest(export_uri).stage
    return EvalSource(eval_label(stage), manifest_uri=export_uri)


def dir_source(model_dir: str) -> EvalSource:
    """An exported HF model directory (anywhere), labelled by a hash of its resolved path."""
    path = str(Path(model_dir).expanduser().resolve())
    return EvalSource(f"dir-{hashlib.sha256(path.encode()).hexdigest()[:12]}", model_dir=path)


def endpoint_source(url: str, served_model: str | None = None) -> EvalSource:
    """A model behind an OpenAI-compatible server at ``url``, labelled by a hash of URL and model."""
    key = f"{url.rstrip('/')} {served_model or ''}"
    label = f"endpoint-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return EvalSource(label, endpoint=url.rstrip("/"), served_model=served_model)


# --------------------------------------------------------------------------------------------------
# Rollouts: the rollouts table (a batch's prompts: verl_core.data.prompt_stream)


def rollouts_table(
    completions: list[Completion],
    prompts: pa.Table,
    iteration: int,
    policy_version: int,
    is_baseline: Sequence[bool] | None = None,
    trajectories: Sequence[Trajectory | None] | None = None,
    group_offset: int = 0,
) -> pa.Table:
    """One row per completion (kind "rollouts"); ``prompts`` are the generate() input rows.
    ``group_offset``: added to the prompt's row in ``prompts`` to give its group id (a generation
    batch K > 0 of a dynamically sampled iteration: K·B, so its groups follow the earlier batches').
    ``is_baseline[i]``: completion i is a greedy baseline (ReMax), not a training sample.
    ``trajectories[i]``: completion i's multi-turn trajectory (its loss mask and turns), None: single-turn.
    ``policy_version``: the version of the weights the rollout engine held (``engine.policy_version``),
    not the trainer's: a stale engine shows in the table."""
    multi = list(trajectories) if trajectories is not None else [None] * len(completions)
    names = ("group_id", "sample_index", "prompt_index", "data_source", "ground_truth", "prompt_text")
    cols: dict[str, list[Any]] = {name: [] for name in names}
    index = prompts.column("index").to_pylist()
    source = prompts.column("data_source").to_pylist()
    truth = prompts.column("ground_truth").to_pylist()
    text = prompts.column("prompt_text").to_pylist()
    # the prompt row's extra_info (a prompt_tokens file written before it was carried has none: null)
    has_info = "extra_info" in prompts.column_names
    info = prompts.column("extra_info").to_pylist() if has_info else [None] * prompts.num_rows
    for c in completions:
        p = c.prompt_index
        cols["group_id"].append(group_offset + p)
        cols["sample_index"].append(c.sample_index)
        cols["prompt_index"].append(index[p])
        cols["data_source"].append(source[p])
        cols["ground_truth"].append(truth[p])
        cols["prompt_text"].append(text[p])
    return pa.table(
        {
            "iteration": pa.array([iteration] * len(completions), pa.int64()),
            **cols,
            "prompt_ids": [c.prompt_ids for c in completions],
            "response_ids": [c.response_ids for c in completions],
            "response_text": [c.response_text for c in completions],
            "logprobs": [c.logprobs for c in completions],
            "finish_reason": [c.finish_reason for c in completions],
            "prompt_length": pa.array([len(c.prompt_ids) for c in completions], pa.int32()),
            "response_length": pa.array(  # model tokens: a multi-turn response's tool tokens do not count
                [
                    len(c.response_ids) if t is None else sum(t.loss_mask)
                    for c, t in zip(completions, multi, strict=True)
                ],
                pa.int32(),
            ),
            "policy_version": pa.array([policy_version] * len(completions), pa.int64()),
            "is_baseline": pa.array(
                [False] * len(completions) if is_baseline is None else list(is_baseline), pa.bool_()
            ),
            "loss_mask": pa.array([None if t is None else t.loss_mask for t in multi], TOKEN_MASK),
            "turns": pa.array([None if t is None else turns_to_rows(t.turns) for t in multi], TURNS),
            "extra_info": pa.array([info[c.prompt_index] for c in completions], EXTRA_INFO),
        }
    )


# --------------------------------------------------------------------------------------------------
# The update's batch: what ppo_update reads of an iteration and the per-sample table it writes


def update_inputs(rollout_uri: str | Sequence[str], reward_uri: str | Sequence[str]) -> dict[str, str]:
    """The update stage's inputs: ``rollout``/``reward``, or ``rollout/gen-K``/``reward/gen-K`` for the
    generation batches of a dynamically sampled iteration."""
    if isinstance(rollout_uri, str) and isinstance(reward_uri, str):
        return {"rollout": rollout_uri, "reward": reward_uri}
    r, w = list(rollout_uri), list(reward_uri)
    return {
        **{f"rollout/gen-{k}": uri for k, uri in enumerate(r)},
        **{f"reward/gen-{k}": uri for k, uri in enumerate(w)},
    }


def read_update_tables(
    store: ArtifactStore, rollout_uri: str | Sequence[str], reward_uri: str | Sequence[str]
) -> tuple[pa.Table, pa.Table, pa.Table | None]:
    """The rollouts and rewards the update trains on, and (dynamic sampling) the group filters of
    every generation batch (None for one batch). Generation batches: their kept rows, in batch order."""
    if isinstance(rollout_uri, str) and isinstance(reward_uri, str):
        rollouts = store.read_table(store.read_manifest(rollout_uri), "rollouts.parquet")
        return rollouts, store.read_table(store.read_manifest(reward_uri), "rewards.parquet"), None
    if len(rollout_uri) != len(reward_uri) or not rollout_uri:
        raise DataError(
            f"ppo_update: {len(rollout_uri)} rollout and {len(reward_uri)} reward generation batches"
        )
    parts: list[tuple[pa.Table, pa.Table, pa.Table]] = []
    for r, w in zip(rollout_uri, reward_uri, strict=True):
        scored = store.read_manifest(w)
        parts.append(
            (
                store.read_table(store.read_manifest(r), "rollouts.parquet"),
                store.read_table(scored, "rewards.parquet"),
                store.read_table(scored, "group_filter.parquet"),
            )
        )
    filters = pa.concat_tables([f for _, _, f in parts])
    kept = filters.column("kept")
    rollouts = pa.concat_tables([r for r, _, _ in parts]).filter(kept)
    return rollouts, pa.concat_tables([w for _, w, _ in parts]).filter(kept), filters


def check_policy_lag(
    rollouts: pa.Table, trainer_version: int, rollout_ahead: int, iteration: int, rollout_uri: str
) -> None:
    """Refuse rollouts whose oldest ``policy_version`` lags ``trainer_version`` by more than
    ``rollout_ahead`` (or is newer than the trainer's, which no sync can produce)."""
    oldest = pc.min(rollouts.column("policy_version")).as_py()
    newest = pc.max(rollouts.column("policy_version")).as_py()
    if oldest is None:
        return
    if trainer_version - oldest > rollout_ahead or newest > trainer_version:
        bad = oldest if trainer_version - oldest > rollout_ahead else newest
        raise DataError(
            f"ppo_update: iteration {iteration}: {rollout_uri} was sampled with policy version {bad}, "
            f"but the trainer is at version {trainer_version} and trainer.rollout_ahead={rollout_ahead} "
            "allows a rollout at most that many versions behind: the rollout engine did not receive the "
            "updated weights (weight sync), or the rollout is from another run"
        )


def update_table(
    batch: RolloutBatch, adv: Tensor, returns: Tensor, kl: Tensor | None, old_logp: Tensor | None = None
) -> pa.Table:
    """One row per training sample (kind "update"): per-token values ``(S, R)`` cut to the response
    length (``old_log_probs`` null without ``old_logp``)."""
    lengths = [len(r) for r in batch.response_ids]

    def rows(t: Tensor | None) -> list[list[float]]:
        if t is None:
            return [[] for _ in lengths]
        return [t[i, :n].tolist() for i, n in enumerate(lengths)]

    return pa.table(
        {
            "group_id": pa.array(batch.group_ids.tolist(), pa.int64()),
            "sample_index": pa.array(batch.sample_index.tolist(), pa.int32()),
            "score": pa.array(batch.scores.tolist(), pa.float32()),
            "advantages": pa.array(rows(adv), pa.list_(pa.float32())),
            "returns": pa.array(rows(returns), pa.list_(pa.float32())),
            "kl": pa.array(rows(kl), pa.list_(pa.float32())),
            "old_log_probs": pa.array(
                [None] * len(lengths) if old_logp is None else rows(old_logp), pa.list_(pa.float32())
            ),
        }
    )
