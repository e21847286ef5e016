"""Data- and tensor-parallel strategies on torch.distributed: FSDP2 (``fully_shard``) over a 2-D
``("dp", "tp")`` device mesh, launched with torchrun.

FSDP2 shards each decoder layer and then the root module over the data-parallel ranks; gradients are
reduce-scattered (averaged over those ranks), which the engine compensates by scaling each rank's
loss by ``dp_size`` (the loss normaliser is global). Batches are split across data-parallel ranks
with Karmarkar–Karp so every rank gets about the same number of tokens; the ranks of one
tensor-parallel group train on the same shard. Checkpoints hold *full* model and optimizer state
keyed by parameter name (:func:`full_model_state`, :func:`full_optimizer_state`), so any world size
(one process included) resumes from any other.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_core.data.packing import karmarkar_karp
from verl_core.errors import ConfigError
from verl_core.models.loading import unwrap
from verl_core.runtime.ranks import distributed
from verl_core.training.precision import MixedPrecision

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


# Process-group backends by device type: on CUDA, NCCL for CUDA tensors and gloo for CPU ones (object
# collectives and CPU-side all-reduces, which NCCL cannot carry); on CPU, gloo.
PROCESS_GROUP_BACKENDS = {"cuda": "cpu:gloo,cuda:nccl", "cpu": "gloo"}


def init_distributed(device_type: str = "cpu", timeout_s: float = 0.0) -> tuple[int, int]:
    """Join the default process group from torchrun's environment; returns ``(rank, world_size)``.
    Without torchrun's variables: a single process, (0, 1). Every SPMD rank joins through this (the
    launcher's workers included).

    On CUDA the rank's device is set first, from ``LOCAL_RANK``: NCCL binds its communicators to the
    current device, which before ``set_device`` is ``cuda:0`` on every rank. The backend comes from
    :data:`PROCESS_GROUP_BACKENDS`.

    ``timeout_s > 0``: a collective that waits longer raises (a rank stuck or gone) instead of
    hanging; pass ``execution.stall_timeout_s``, the same bound as the stage watchdog
    (:mod:`verl_core.runtime.watchdog`). 0: torch's default (10 min for NCCL, 30 min for gloo)."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s) if timeout_s > 0 else None  # None: torch's default
        dist.init_process_group(backend=PROCESS_GROUP_BACKENDS[device_type], timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def rank_shard(lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Indices of the sequences this rank trains on: Karmarkar–Karp equal-size parts (verl's
    ``balance_batch``), deterministic on every rank. Needs at least ``world_size`` sequences."""
    if len(lengths) < world_size:
        raise ValueError(f"{len(lengths)} sequences cannot be split over {world_size} ranks")
    parts = karmarkar_karp(lengths, world_size, equal_size=len(lengths) % world_size == 0)
    return sorted(parts[rank])


class FSDP2Strategy:
    """FSDP2 over all ranks of the default process group, optionally with tensor parallelism.

    The ranks form a 2-D device mesh ``("dp", "tp")`` of shape ``(world / tp_size, tp_size)`` (rank
    ``r`` sits at ``(r // tp_size, r % tp_size)``: the ranks of one tensor-parallel group are
    neighbours, on one node). Each decoder layer's attention and MLP projections are split over the
    ``tp`` ranks (:func:`tp_plan`, Megatron's column → row pairs), then every decoder layer and the
    root module are sharded with ``fully_shard`` over the ``dp`` ranks. Embeddings, norms and the
    output head are not tensor-parallel: every ``tp`` rank holds them whole (sharded over ``dp``), so
    the chunked log-prob reads the head's weight as a plain tensor. Gradients are averaged over the
    ``dp`` ranks only: the engine scales each rank's loss by ``dp_size``.

    ``mixed_precision``: FSDP2's ``MixedPrecisionPolicy``: each unit's parameters are all-gathered in
    ``param_dtype`` for compute while the sharded master parameters (and so the optimizer state) keep
    their own dtype; gradients are reduce-scattered in ``reduce_dtype`` and land in the master dtype.
    Outputs are left in the compute dtype (``output_dtype`` None): the chunked log-prob and the value
    head upcast to fp32 themselves (:mod:`verl_core.training.precision`).

    ``param_offload``: FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and the optimizer
    state live on the CPU and each layer's parameters are copied to the device for its compute (on a
    CPU-only run nothing moves; only the code path differs)."""

    def __init__(
        self,
        device_type: str = "cpu",
        tp_size: int = 1,
        param_offload: bool = False,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("FSDP2Strategy needs torch.distributed initialised (launch with torchrun)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if tp_size < 1 or self.world_size % tp_size:
            raise ConfigError(
                f"actor.tensor_parallel_size={tp_size} must divide the world size {self.world_size}"
            )
        self.device_type = device_type
        self.tp_size = tp_size
        self.dp_size = self.world_size // tp_size
        self.mesh = init_device_mesh(device_type, (self.dp_size, tp_size), mesh_dim_names=("dp", "tp"))
        self.dp_mesh, self.tp_mesh = self.mesh["dp"], self.mesh["tp"]
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.dp_group: dist.ProcessGroup | None = self.dp_mesh.get_group()
        self.param_offload = param_offload
        self.mixed_precision = mixed_precision

    def prepare(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {"mesh": self.dp_mesh}
        mp = self.mixed_precision
        if mp is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype
            )
        if self.param_offload:  # pin_memory needs an accelerator
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device_type != "cpu")
        elif self.device_type == "cuda":
            model = model.to(torch.device("cuda", torch.cuda.current_device()))
        layers = decoder_layers(model)
        if self.tp_size > 1:
            check_tp_divides(model_config(model), self.tp_size)
            for layer in layers:
                parallelize_layer(layer, self.tp_mesh)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """Clip to a global L2 norm ``‖g‖ = sqrt(Σ_p ‖g_p‖²)`` over all parameters (whole, not shards);
        returns ‖g‖ before clipping. With tensor parallelism the gradients live on two meshes
        (``dp`` alone, ``dp × tp``): each mesh's part is reduced on its own, then the squares add."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        by_mesh: dict[Any, list[Tensor]] = {}
        for g in grads:
            by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
        squares = []
        for part in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(part, norm_type=2.0)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            squares.append(norm.float() ** 2)
        total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
        # g ← g · min(1, max_norm / (‖g‖ + 1e-6)), as torch.nn.utils.clip_grad_norm_
        coef = min(1.0, max_norm / (float(total) + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        return total

    def all_reduce_sum(self, value: float) -> float:
        """Σ over the data-parallel ranks (the ``tp`` ranks of one group hold the same value)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=self.dp_group)
        return float(t.item())


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of a packed wrapper (``decoder_layers()``) or of an HF causal LM."""
    get_layers = getattr(model, "decoder_layers", None)
    layers: nn.ModuleList = get_layers() if callable(get_layers) else unwrap(model).get_decoder().layers
    return layers


def model_config(model: nn.Module) -> Any:
    """The HF config of the first module inside ``model`` that has one."""
    return next(m.config for m in model.modules() if hasattr(m, "config"))


def check_tp_divides(config: Any, tp_size: int) -> None:
    """Each tensor-parallel rank computes whole attention heads: tp must divide the query and
    key/value head counts (and the MLP width)."""
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp_size]
    if bad:
        raise ConfigError(f"actor.tensor_parallel_size={tp_size} does not divide {', '.join(bad)}")


def tp_plan() -> dict[str, ParallelStyle]:
    """Megatron-style split of a Qwen2/Llama decoder layer: q/k/v and gate/up by output features
    (each rank computes its own heads / MLP columns from the whole input), o and down by input
    features (partial sums all-reduced into the whole output)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def parallelize_layer(layer: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Apply :func:`tp_plan` to one decoder layer in place. The attention then sees its local heads
    (HF reshapes by ``-1`` heads; :mod:`verl_core.models.attention` derives the GQA ratio from the
    shapes)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(layer, tp_mesh, tp_plan())


# --- full (unsharded) state, every rank calls these: a checkpoint from any world size loads at any other


def _full(cpu_offload: bool = False) -> StateDictOptions:
    """Whole tensors (gathered from FSDP shards and tensor-parallel pieces), optionally copied to CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """The whole model's state dict on CPU, keyed by parameter name (FSDP shards and tensor-parallel
    pieces gathered). Every rank must call it; under torch.distributed only rank 0 receives the
    tensors (the others get ``{}``), and rank 0 saves them. Works on a plain module too."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_full(cpu_offload=True))
    return {k: v for k, v in state.items() if isinstance(v, Tensor)}


def load_full_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a whole-model state (as :func:`full_model_state` returns) into ``model``, sharded or not;
    every rank calls it with the same ``state``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, dict(state), options=_full())  # dict(): the annotation is invariant


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's whole state on CPU keyed by parameter name (``{"state": {name: {...}},
    "param_groups": [{..., "params": [name, ...]}]}``), independent of the world size. Every rank
    must call it; under torch.distributed only rank 0 receives the state tensors."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: dict[str, Any] = get_optimizer_state_dict(model, optimizer, options=_full(cpu_offload=True))
    return state


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Load a :func:`full_optimizer_state` into ``optimizer`` of ``model``, sharded or not; every rank
    calls it with the same ``state``."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_full())


def policy_weights(lm: nn.Module, *, keep: bool = True) -> dict[str, Tensor]:
    """The policy's full state dict (the names of ``lm.state_dict()``, each tensor its full shape, e.g.
    ``(V, H)`` for the embedding) for a rollout engine holding its own weights. One process: the plain
    state dict (as it is; DeepSpeed's gathered, cloned).

    Sharded (FSDP2 / TP parameters are DTensors, DeepSpeed ZeRO-3 partitions) every rank must call
    (all-gathers). The full tensors are gathered one at a time, each moved to the CPU as it arrives
    and kept only where ``keep`` (the ranks that own an engine; the others get ``{}``): one CPU copy
    per engine, and no rank ever holds more than one full tensor on its device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    if any(hasattr(p, "ds_id") for p in lm.parameters()):  # DeepSpeed ZeRO-3 partitions
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(lm.parameters())):
            if not distributed():
                return {k: v.detach().clone() for k, v in lm.state_dict().items()}
            return {k: v.detach().to("cpu", copy=True) for k, v in lm.state_dict().items()} if keep else {}
    sharded = any(isinstance(p, DTensor) for p in lm.parameters())
    if not sharded and not distributed():
        return lm.state_dict()
    state = get_model_state_dict(lm, options=StateDictOptions(full_state_dict=False))
    # tied weights are gathered once, decided by the module's structure (the same on every rank: each
    # gather is a collective); the state dict's tensors are distinct objects even where tied
    first_name: dict[str, str] = {}
    by_param: dict[int, str] = {}
    for pname, param in lm.named_parameters(remove_duplicate=False):
        first_name[pname] = by_param.setdefault(id(param), pname)
    out: dict[str, Tensor] = {}
    gathered: set[str] = set()
    for name, value in state.items():
        if not isinstance(value, Tensor):
            continue
        source = first_name.get(name, name)
        if source in gathered:
            if keep:
                out[name] = out[source]
            continue
        gathered.add(name)
        if isinstance(value, DTensor):
            # a collective on the mesh's device: an offloaded (CPU) shard moves there first, as in
            # torch's own full state dict (torch.distributed._state_dict_utils._gather_state_dict)
            mesh = value.device_mesh.device_type
            shard = value if value.device.type == mesh else value.to(mesh)  # .to keeps a DTensor
            full = cast(DTensor, shard).full_tensor()
        else:
            full = value.detach()
        if keep:
            out[name] = full.to("cpu", copy=True)
        del full
    return out
