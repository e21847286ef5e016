"""Rollouts with vLLM (GPU worker image only: ``pip install 'verl-flow[gpu]'``).

``vllm`` is imported inside the constructor, so this module imports on any machine; constructing
:class:`VLLMEngine` runs :func:`verl_core.doctor.require` first: without vllm, with a torch or
transformers that vLLM's own metadata does not accept, or without a CUDA torch and GPU it raises a
:class:`ConfigError` (the lines of ``verl-flow doctor``).

Mapping onto the contract of :mod:`verl_core.rollout.base`:
- prompts are always sent as ``TokensPrompt(prompt_token_ids=...)`` (strings are encoded here with
  ``add_special_tokens=False``, exactly as the HF engine does), so both engines see the same ids;
- behaviour log-probs: the engine runs with ``logprobs_mode="processed_logprobs"`` and requests
  ``logprobs=0`` (the sampled token only). vLLM's processed log-probs are taken after temperature
  *and* after top-k/top-p (its sampler, step 7), while ours are before top-k/top-p. They agree when
  top-k and top-p are off (the usual RL rollout setting) and in greedy mode (T = 1 log-probs, no
  truncation); with top-k/top-p on, vLLM returns log-probs of the truncated, renormalised
  distribution and :meth:`VLLMEngine.generate` warns: let the trainer recompute old log-probs then.
  ``raw_logprobs`` would be right only at T = 1;
- stop strings stay in the text (``include_stop_str_in_output=True``), like the HF engine's cut;
  eos, ``<|im_end|>`` and ``stop_token_ids`` are stop tokens, kept in ``response_ids``;
- seeding (the contract's per-row seeds): each (prompt, sample) is its own request with ``n=1`` and
  the per-request ``seed=derive_seed("sample", seed, prompt_key, sample_index)``, so a prompt's
  samples do not depend on the other prompts of the call (vLLM's generator is per request). vLLM's
  sampler is not the HF engine's: the same seed gives other tokens than the HF engine;
- weight sync (the engine never shares the trainer's module): ``load_weights(named_tensors, v)``
  sends HF-named weights (merged, no LoRA names) straight into the worker models with
  ``llm.apply_model(lambda m: m.load_weights(...))`` (vLLM ≥ 0.10, V1 engine; the function is
  pickled to the workers, which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set here) and resets
  the prefix cache; with ``enable_lora=True``, ``load_adapter(adapter_state_dict, v)`` writes the
  adapter (PEFT layout) to a temp dir and sends it as a new ``LoRARequest`` (a new int id per
  load: vLLM caches adapters by id), the base staying loaded. ``update_weights(model, v)`` does
  either from a live module;
- ``sleep()`` / ``wake_up()``: ``llm.sleep(level=1)`` (weights offloaded to CPU, KV cache dropped) and
  ``llm.wake_up()``; the engine is built with ``enable_sleep_mode=True``.

Not run in this repository's CI (no GPU, no vllm): see ``tests/verl_core/rollout/test_vllm.py``.
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
from verl_core.doctor import require
from verl_core.errors import ConfigError
from verl_core.models.loading import unwrap
from verl_core.rollout.base import Completion, FinishReason, SamplingParams
from verl_core.rollout.hf import encode_prompts
from verl_core.rollout.sampler import check_prompt_keys
from verl_core.seeding import derive_seed
from verl_core.watchdog import beat


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


class VLLMEngine:
    """:class:`~verl_core.rollout.base.RolloutEngine` on ``vllm.LLM``.

    ``model`` is a path / hub id, or a live ``nn.Module`` whose weights are written once to a temp dir
    for vLLM to load (later updates go through memory). A live PEFT model turns ``enable_lora`` on:
    its base is written once and each sync sends the adapter."""

    def __init__(
        self,
        model: str | nn.Module,
        tokenizer: Any = None,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enable_lora: bool = False,
        max_lora_rank: int = 64,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        max_model_len: int | None = None,
        policy_version: int = 0,
    ) -> None:
        # vllm present, its own torch/transformers pins met, a CUDA torch and a GPU (verl_core.doctor)
        require({"vllm": "rollout.name: 'vllm'"}, cuda_needed_by="rollout.name: 'vllm'")
        import vllm

        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model pickles a function
        if hasattr(model, "peft_config"):  # a live LoRA policy: its adapter is what every sync sends
            enable_lora = True
            max_lora_rank = max(max_lora_rank, int(model.peft_config["default"].r))  # type: ignore[union-attr,index]
        self._tmp = tempfile.TemporaryDirectory(prefix="verl-flow-vllm-")
        path = model if isinstance(model, str) else self._save_for_init(model, tokenizer, enable_lora)
        kwargs: dict[str, Any] = {}
        if enable_lora:
            kwargs["max_lora_rank"] = max_lora_rank
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # an SPMD job (torchrun): one engine per group of tensor_parallel_size consecutive ranks, in
            # the job's own processes (vLLM's external launcher, as verl runs it); each group generates
            # its share of the prompts (stages.floor.builders.sharded_rollouts)
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.tensor_parallel_size = tensor_parallel_size
        self.llm = vllm.LLM(
            model=path,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_lora=enable_lora,
            enable_sleep_mode=True,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            logprobs_mode="processed_logprobs",
            **kwargs,
        )
        self.tokenizer = tokenizer if tokenizer is not None else self.llm.get_tokenizer()
        self.enable_lora = enable_lora
        self.shares_weights = False  # the workers hold their own weights: synced after every update
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
        """Load ``model``'s current weights into the running engine (no disk round-trip), or with
        ``enable_lora`` send its adapter as a new LoRA version; the engine then holds ``version``
        (default: the held version + 1)."""
        version = self._version + 1 if version is None else version
        if self.enable_lora and hasattr(model, "peft_config"):
            from peft import get_peft_model_state_dict

            self._lora_config = model.peft_config["default"]  # type: ignore[index]
            self.load_adapter(get_peft_model_state_dict(model), version)
        else:
            self.load_weights(merged_state_dict(model).items(), version)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """HF-named full weights (LoRA merged in) → the worker models, as policy ``version``."""
        sent = [(name, t.detach()) for name, t in weights]
        self.llm.apply_model(lambda m: m.load_weights(iter(sent)))
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
        from vllm.lora.request import LoRARequest

        self._lora_loads += 1
        path = os.path.join(self._tmp.name, f"adapter-{self._lora_loads}")
        self._lora_config.save_pretrained(path)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in weights.items()},
            os.path.join(path, "adapter_model.safetensors"),
        )
        self._lora = LoRARequest(f"policy-v{version}-{self._lora_loads}", self._lora_loads, path)
        self._version = version

    def sleep(self) -> None:
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

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
        unwrap(model).save_pretrained(path, state_dict=merged_state_dict(model, base_only=base_only))
        tokenizer.save_pretrained(path)
        return path


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

    For a plain model this is its parameters by name (tied weights once, as vLLM expects)."""
    base = unwrap(model)
    out: dict[str, Tensor] = {}
    for name, param in _named_weights(base):
        out[name] = param.detach()
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
    """Parameters without LoRA's own (``lora_A``/``lora_B``/...) and with PEFT's ``.base_layer``
    removed from the names, so they read as the plain HF checkpoint's."""
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), param
