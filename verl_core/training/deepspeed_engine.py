"""DeepSpeed ZeRO-1/2/3 training engine with the same surface as :class:`TrainEngine`.

Optional: needs ``pip install 'verl-flow[deepspeed]'`` and a torchrun launch. DeepSpeed owns
the optimizer partitioning, gradient clipping and the step; we keep torch's AdamW (no JIT-compiled
DeepSpeed Adam), our LR schedule, and the loss convention of :mod:`verl_core.training.engine`
(micro-batch losses are shares of the mini-batch loss, so ``scale_wrt_gas=False``; each rank's loss
is multiplied by the data-parallel size because DeepSpeed averages gradients over those ranks).

Checkpoints. :meth:`DeepSpeedTrainEngine.full_state_dict` gathers the whole model (fp32 master weights
where the optimizer keeps them) onto rank 0 for the HF export. :meth:`~DeepSpeedTrainEngine.state_dict`
is DeepSpeed's own per-rank checkpoint (``save_checkpoint``: each rank's optimizer partition), its files
gathered onto rank 0 as uint8 tensors, so :func:`verl_core.models.checkpoint.state_bytes` can store it
and every rank can load it back. A partition belongs to its world size: resuming with another one is
refused (DeepSpeed's universal-checkpoint conversion is not wired in). DeepSpeed reads its files with
an unrestricted unpickler, so each file must first pass torch's weights-only unpickler.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_core.errors import ArtifactCorruptError, ConfigError
from verl_core.runtime.doctor import require
from verl_core.runtime.watchdog import beat
from verl_core.training.distributed import init_distributed
from verl_core.training.engine import (
    ADAM_BETAS,
    NonFiniteError,
    OptimSpec,
    StepStats,
    lr_schedule,
    param_groups,
)
from verl_core.training.precision import MixedPrecision

T = TypeVar("T")

FORMAT = "deepspeed-zero-per-rank"  # state_dict()["format"]
_TAG = "state"  # the checkpoint tag inside DeepSpeed's directory layout


def deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _skip_shm_comm_op() -> None:
    """On CPU DeepSpeed JIT-compiles a shared-memory all-reduce op at start-up (slowly), used
    only by its inference all-reduce (AutoTP), never by ZeRO training. Marking the op incompatible in
    DeepSpeed's cache of compatible ops (edits persist there) makes it fall back to torch.distributed."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def deepspeed_config(grad_clip: float, zero_stage: int, mp: MixedPrecision | None) -> dict[str, Any]:
    """DeepSpeed's JSON config. ``mp`` with ``param_dtype`` bf16: its ``bf16`` block (the module
    computes in bf16, the ZeRO optimizer keeps fp32 master partitions) and ``communication_data_type``
    from ``reduce_dtype``; fp16 (loss scaling) is not offered."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": mp is not None and mp.param_dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
    }
    if mp is not None:
        config["communication_data_type"] = {torch.float32: "fp32", torch.bfloat16: "bf16"}[mp.reduce_dtype]
    return config


class DeepSpeedTrainEngine:
    """ZeRO-``zero_stage`` over every rank of the default process group (data parallel only: the
    data-parallel group is the world)."""

    def __init__(
        self,
        model: nn.Module,
        spec: OptimSpec,
        *,
        zero_stage: int = 2,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        require({"deepspeed": "actor.strategy: 'deepspeed'"})  # installed, its torch pin met
        if zero_stage not in (1, 2, 3):
            raise ConfigError(f"zero_stage: {zero_stage}; DeepSpeed ZeRO stages are 1, 2 and 3")
        import deepspeed

        if not torch.cuda.is_available():
            _skip_shm_comm_op()
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        # under torchrun: our one join (device set first, cpu:gloo + cuda:nccl); DeepSpeed then reuses
        # the group. A single process without torchrun's variables: DeepSpeed sets up its own.
        init_distributed(device_type)
        deepspeed.init_distributed(dist_backend="nccl" if device_type == "cuda" else "gloo")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world_size
        self.dp_group: dist.ProcessGroup | None = dist.group.WORLD if self.world_size > 1 else None
        self.spec = spec
        self.zero_stage = zero_stage
        # ZeRO drops empty parameter groups (LoRA has no 1-D parameters), and the LR schedule must
        # then see the same groups as the wrapped optimizer
        groups = [g for g in param_groups(model, spec.weight_decay) if g["params"]]
        optimizer = torch.optim.AdamW(groups, lr=spec.lr, betas=ADAM_BETAS, foreach=False)
        scheduler = lr_schedule(optimizer, spec)
        config = deepspeed_config(spec.grad_clip, zero_stage, mixed_precision)
        if zero_stage == 3:
            _register_output_head(model)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        self.model: nn.Module = self.engine
        self.global_step = 0

    def step(
        self, micro_batches: Sequence[T], loss_fn: Callable[[T], Tensor], *, where: str = "train"
    ) -> StepStats:
        """Accumulate over ``micro_batches`` and step (see :meth:`TrainEngine.step`). A non-finite
        loss raises before the step; a non-finite gradient norm is caught by DeepSpeed's overflow check
        in mixed precision and raises here after it (the step is then skipped by DeepSpeed)."""
        self.engine.train()
        total = 0.0
        for i, mb in enumerate(micro_batches):
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            loss = loss_fn(mb)
            if not torch.isfinite(loss):
                raise NonFiniteError(
                    f"{where}: loss is {loss.item()} at step {self.global_step}, micro-batch {i}"
                )
            self.engine.backward(loss * self.dp_size, scale_wrt_gas=False)
            total += float(loss.detach())
            beat(optimizer_step=self.global_step + 1, micro_batch=f"{i + 1}/{len(micro_batches)}")
        lr = float(self.scheduler.get_last_lr()[0])
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        norm = float(grad_norm) if grad_norm is not None else float("nan")
        if grad_norm is not None and not torch.isfinite(torch.tensor(norm)):
            raise NonFiniteError(f"{where}: grad_norm is {norm} at step {self.global_step}")
        self.global_step += 1
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t, group=self.dp_group)
        return StepStats(float(t.item()), norm, lr, len(micro_batches))

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state dict as CPU tensors on rank 0 (``{}`` on the other ranks; every rank
        must call it). Trainable parameters come from the optimizer's fp32 master copy
        (``safe_get_full_fp32_param``: an all-reduce of the partitions, ZeRO-3 included); frozen ones
        and buffers from the module (gathered with ``GatheredParameters`` under ZeRO-3). Tied
        parameters appear under each of their names, as in ``nn.Module.state_dict``."""
        from deepspeed import zero
        from deepspeed.utils import safe_get_full_fp32_param

        module: nn.Module = self.engine.module
        full: dict[int, Tensor] = {}  # id(param) -> full tensor, once per shared parameter
        out: dict[str, Tensor] = {}
        for name, value in module.state_dict(keep_vars=True).items():
            if id(value) not in full:
                trained = isinstance(value, nn.Parameter) and value.requires_grad  # frozen: no master
                master = safe_get_full_fp32_param(value) if trained else None
                if master is None:
                    with zero.GatheredParameters([value] if hasattr(value, "ds_id") else []):
                        master = value.detach().clone()
                full[id(value)] = master.detach().cpu() if self.rank == 0 else master.new_empty(0)
            if self.rank == 0:
                out[name] = full[id(value)]
        return out

    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's checkpoint of every rank (optimizer partitions, scheduler, module) as
        ``{file name: uint8 tensor}`` on rank 0 (every rank must call it; the others get the same
        header with no files)."""
        with tempfile.TemporaryDirectory() as tmp:
            self.engine.save_checkpoint(tmp, tag=_TAG, save_latest=False)
            mine = {
                os.path.relpath(os.path.join(d, f), tmp): _read(os.path.join(d, f))
                for d, _, names in os.walk(tmp)
                for f in names
                if f.endswith(".pt")  # not the zero_to_fp32.py script DeepSpeed copies beside them
            }
        gathered: list[dict[str, bytes] | None] = [None] * self.world_size
        dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0)
        files: dict[str, Tensor] = {}
        if self.rank == 0:
            for part in gathered:
                for name, data in (part or {}).items():
                    files[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return {
            "format": FORMAT,
            "zero_stage": self.zero_stage,
            "world_size": self.world_size,
            "global_step": self.global_step,
            "files": files,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output (every rank, each given the whole state). Refuses a state
        made with another format, ZeRO stage or world size, naming both."""
        if state.get("format") != FORMAT:
            raise ArtifactCorruptError(f"trainer state is not a DeepSpeed state ({state.get('format')!r})")
        for key, mine in (("world_size", self.world_size), ("zero_stage", self.zero_stage)):
            if state[key] != mine:
                raise ConfigError(
                    f"DeepSpeed checkpoint made with {key} {state[key]} cannot resume with {key} {mine}: "
                    "its optimizer state is partitioned per rank (resume with the same setting)"
                )
        with tempfile.TemporaryDirectory() as tmp:
            for name, data in state["files"].items():
                raw = data.numpy().tobytes()
                _check_weights_only(raw, name)
                path = os.path.join(tmp, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(raw)
            loaded, _ = self.engine.load_checkpoint(tmp, tag=_TAG)
            if loaded is None:
                raise ArtifactCorruptError("DeepSpeed found no checkpoint in the trainer state")
        self.global_step = int(state["global_step"])


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _check_weights_only(data: bytes, name: str) -> None:
    """DeepSpeed loads its files with an unrestricted unpickler: let only files that torch's
    weights-only unpickler accepts reach it, with the three plain-data DeepSpeed classes its ZeRO
    optimizer state holds (the loss scaler's settings, the stage enum, fragment offsets) allowed."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    try:
        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:
        raise ArtifactCorruptError(
            f"DeepSpeed checkpoint file {name}: refused by the weights-only unpickler "
            f"({type(e).__name__}: {str(e).splitlines()[0]})"
        ) from None


def _register_output_head(model: nn.Module) -> None:
    """Under ZeRO-3 a parameter is gathered only while its own module runs; the chunked log-prob reads
    the LM head's weight from the root module's forward (:mod:`verl_core.models.packed`), so the head's
    parameters are registered as used by the root too."""
    from deepspeed import zero

    from verl_core.models.loading import unwrap

    lm = getattr(model, "lm", None)
    if lm is None:
        return
    head = unwrap(lm).get_output_embeddings()
    for p in head.parameters():
        zero.register_external_parameter(model, p)
