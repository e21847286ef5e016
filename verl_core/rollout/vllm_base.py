"""What both vLLM engines share: the weight-update, LoRA-adapter and sleep lifecycle.

:class:`~verl_core.rollout.vllm.VLLMEngine` (vLLM in this process) and
:class:`~verl_core.rollout.vllm_process.VLLMProcessEngine` (vLLM in a subprocess of its own
environment) differ only in how a call reaches vLLM: the four hooks
:meth:`VLLMEngineBase.load_staged_weights`, :meth:`~VLLMEngineBase.load_adapter_dir`,
:meth:`~VLLMEngineBase._generate_ids` and :meth:`~VLLMEngineBase._set_asleep`. Everything else is
here, once:

- ``update_weights``: a LoRA policy sends its adapter, any other its merged full weights;
- ``load_weights``: staged as safetensors buckets (:func:`~verl_core.rollout.weight_sync.staged_weights`),
  then reloaded by vLLM from the directory, which is removed after;
- ``load_adapter``: the adapter written as a PEFT directory ``adapter-<n>`` under the engine's own
  directory and sent as a new LoRA version; the directories older than the previous one are removed
  (vLLM reads an adapter's files when it first uses it, so the current one stays);
- sleep: :meth:`~VLLMEngineBase.sleep` frees the device while the trainer runs where the platform
  has sleep mode (:attr:`can_sleep`; elsewhere a no-op); the engine then wakes itself before anything
  that needs its memory (a weight or adapter load: vLLM's pages are unmapped while asleep; a generate).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.errors import ConfigError
from verl_core.models.loading import unwrap
from verl_core.rollout.base import Completion, SamplingParams
from verl_core.rollout.requests import encode_prompts
from verl_core.rollout.vllm_spec import VLLMSpec
from verl_core.rollout.weight_sync import staged_weights
from verl_core.runtime.ranks import local_world_size
from verl_core.runtime.watchdog import beat

KEEP_ADAPTERS = 2  # adapter directories kept: the current one and the one before


class VLLMEngineBase:
    """The :class:`~verl_core.rollout.base.RolloutEngine` lifecycle of a vLLM engine (see the module
    docstring). A subclass sets :attr:`can_sleep` once vLLM runs and implements the hooks."""

    shares_weights = False  # vLLM's workers hold their own weights: synced after every update
    can_sleep = False  # the platform has sleep mode (set by the subclass once vLLM runs)

    def __init__(self, spec: VLLMSpec, tokenizer: Any, adapter_root: str, policy_version: int) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.tensor_parallel_size = spec.tensor_parallel_size
        self.bucket_bytes = spec.weight_sync_bucket_mb << 20
        self._adapter_root = adapter_root  # where load_adapter writes adapter-<n>
        self._adapters = 0  # adapters written so far
        self._lora_config: Any = None  # a LoRA policy's PEFT config (adapters are then what syncs send)
        self._version = policy_version
        self._asleep = False

    # -- hooks: how a call reaches vLLM ----------------------------------------------------------

    def load_staged_weights(self, directory: str, version: int) -> None:
        """vLLM reloads the weights staged in ``directory``; the engine then holds ``version``."""
        raise NotImplementedError

    def load_adapter_dir(self, path: str, version: int) -> None:
        """vLLM uses the adapter saved in ``path`` (PEFT layout) as policy ``version``."""
        raise NotImplementedError

    def _generate_ids(
        self, prompt_ids: list[list[int]], params: SamplingParams, prompt_keys: Sequence[int] | None
    ) -> list[Completion]:
        raise NotImplementedError

    def _set_asleep(self, asleep: bool) -> None:
        """vLLM's ``sleep(level=1)`` (weights offloaded, KV cache dropped) or ``wake_up()``."""
        raise NotImplementedError

    # -- RolloutEngine ----------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The policy version of the weights vLLM holds."""
        return self._version

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        params = params or SamplingParams()
        if not params.greedy and (params.top_k > 0 or params.top_p < 1.0):
            warnings.warn(
                "vLLM returns log-probs of the top-k/top-p truncated distribution, not the untruncated "
                "softmax(logits / T) of the rollout contract: recompute old log-probs in the trainer",
                stacklevel=2,
            )
        ids = encode_prompts(self.tokenizer, prompts)  # (an engine without a tokenizer takes ids only)
        self.wake_up()
        done = self._generate_ids(ids, params, prompt_keys)
        beat(sequences=len(done))
        return done

    def update_weights(self, model: nn.Module, version: int | None = None) -> None:
        """``model``'s current weights to vLLM: its adapter for a LoRA policy, else its merged full
        weights; the engine then holds ``version`` (default: held + 1)."""
        version = self._version + 1 if version is None else version
        if self._lora_config is not None and hasattr(model, "peft_config"):
            from peft import get_peft_model_state_dict

            self._lora_config = model.peft_config["default"]  # type: ignore[index]
            self.load_adapter(get_peft_model_state_dict(model), version)
        else:
            self.load_weights(merged_state_dict(model).items(), version)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """HF-named full weights (every tensor of the model's ``state_dict``, tied ones included; LoRA
        merged in) → vLLM, as policy ``version``: staged in buckets, then reloaded."""
        self.wake_up()  # vLLM's pages are unmapped while it sleeps
        # staged in the engine's compute dtype (vLLM would cast on load, with the same rounding): fp32
        # masters of a bf16-compute policy stage half their bytes; an SPMD job's engines on this node
        # stage at once, so /dev/shm must hold all of their syncs
        dtype = None if self.spec.dtype == "auto" else getattr(torch, self.spec.dtype)
        syncs = max(1, local_world_size() // self.spec.tensor_parallel_size)
        with staged_weights(weights, self.bucket_bytes, dtype=dtype, syncs_per_node=syncs) as directory:
            self.load_staged_weights(directory, version)

    def load_adapter(self, weights: Mapping[str, Tensor], version: int) -> None:
        """A LoRA adapter (``get_peft_model_state_dict`` names) → a new LoRA version of vLLM, as policy
        ``version``: written with its ``adapter_config.json`` to a new directory; older ones removed."""
        if self._lora_config is None:
            raise ConfigError("vLLM load_adapter: the engine was built without a LoRA policy (enable_lora)")
        from safetensors.torch import save_file

        self.wake_up()
        self._adapters += 1
        path = self._adapter_dir(self._adapters)
        self._lora_config.save_pretrained(path)
        tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        self.load_adapter_dir(path, version)
        shutil.rmtree(self._adapter_dir(self._adapters - KEEP_ADAPTERS), ignore_errors=True)

    def sleep(self) -> None:
        """Offload the weights and drop the KV cache while the trainer runs (where the platform has
        sleep mode, :attr:`can_sleep`; a no-op elsewhere). The engine wakes before its next load or
        generate."""
        if self.can_sleep and not self._asleep:
            self._set_asleep(True)
            self._asleep = True

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed (nothing when awake)."""
        if self._asleep:
            self._set_asleep(False)
            self._asleep = False

    def _adapter_dir(self, n: int) -> str:
        return os.path.join(self._adapter_root, f"adapter-{n}")


def save_for_engine(model: nn.Module, tokenizer: Any, path: str, *, base_only: bool = False) -> None:
    """``model`` (LoRA merged in, or its base alone) and ``tokenizer`` as an HF directory that vLLM
    loads; ``use_cache`` is saved on (a model saved with it off generates slowly for anyone else)."""
    import torch.distributed as dist

    base = unwrap(model)
    weights = merged_state_dict(model, base_only=base_only)
    if dist.is_available() and dist.is_initialized():
        # an SPMD job's engine-owning ranks each write their engine's directory, but transformers 5's
        # save_pretrained writes on global rank 0 alone (`should_save_on_this_rank`): written here
        from safetensors.torch import save_file

        base.config.architectures = [type(base).__name__]  # what vLLM resolves the model class by
        base.config.save_pretrained(path)
        if base.can_generate():
            base.generation_config.save_pretrained(path)
        tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        base.save_pretrained(path, state_dict=weights)
    tokenizer.save_pretrained(path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if not config.use_cache:
        config.use_cache = True
        config.save_pretrained(path)


def merged_state_dict(model: nn.Module, *, base_only: bool = False) -> dict[str, Tensor]:
    """HF-named weights of ``model`` with LoRA adapters merged in (``W + scale·B·A``), computed into new
    tensors: the model itself is not touched (no ``merge_and_unload``). ``base_only`` skips the merge.

    Every entry of the plain model's ``state_dict`` — tied weights under each of their names (a tied
    ``lm_head.weight`` too: vLLM's CPU backend holds the output projection apart from the embedding)."""
    base = unwrap(model)
    out: dict[str, Tensor] = dict(_named_weights(base))
    if base_only or not hasattr(model, "peft_config"):
        return out
    for module_name, module in base.named_modules():
        get_delta = getattr(module, "get_delta_weight", None)
        adapters = getattr(module, "active_adapters", None)
        if get_delta is None or not adapters or getattr(module, "merged", False):
            continue
        key = f"{module_name}.weight"
        weight = out[key]
        for adapter in adapters:
            if adapter in getattr(module, "lora_A", {}):
                weight = weight + get_delta(adapter).to(weight.dtype)
        out[key] = weight
    return out


def _named_weights(base: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``state_dict`` entries without LoRA's own (``lora_A``/``lora_B``/...) and with PEFT's
    ``.base_layer`` removed from the names, so they read as the plain HF checkpoint's."""
    for name, tensor in base.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), tensor.detach()
