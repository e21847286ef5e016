"""Rollouts with a transformers model and its KV cache, for CPU runs and single-GPU colocated training.

How a ``generate(prompts, params)`` call runs:
1. prompts → token ids (strings are encoded as-is, ``add_special_tokens=False``), checked against
   ``max_position_embeddings``;
2. each prompt repeated ``n`` times → requests ``(prompt_index, sample_index, ids)``;
3. requests sorted by prompt length and cut into batches of at most ``max_batch_size`` sequences and
   ``max_batch_tokens`` padded tokens (bucketing: little left padding inside a batch);
4. each batch left-padded and decoded by one of two paths (``decode``), both drawing through the
   one sampler (:class:`~verl_core.rollout.sampler.TokenSampler`: records the behaviour log-probs,
   applies temperature / top-k / top-p, draws the token with the row's own uniform at each step, a
   hash of (row key, step) where row key = ``derive_seed("sample", seed, prompt_key, sample_index)``,
   :func:`verl_core.seeding.counter_uniforms`): a row draws the same tokens whatever batch, call or
   rank it is generated in, so a rollout split over ranks (each passing its prompts' ``prompt_keys``)
   samples exactly what one process does. The paths:
   - ``loop``: the engine's own loop over a static KV cache (:func:`verl_core.rollout.decode.decode_loop`),
     eager; the CPU default (see ``benchmarks/rollout.py``);
   - ``compiled``: the same loop with the decode step compiled into CUDA graphs, batch and cache
     length bucketed to powers of two (:class:`~verl_core.rollout.decode.CompiledStep`); the CUDA
     default; elsewhere, or when compiling fails, it runs eager and logs why;
   ``auto`` picks ``compiled`` on CUDA, ``loop`` elsewhere; the choice is logged once per engine.
   :meth:`HFEngine.generate_reference` decodes the same batches with transformers ``generate``
   (:func:`verl_core.rollout.decode.reference_decode`): the reference both paths are tested against;
5. responses cut at the first stop token or stop string, results put back in
   ``(prompt_index, sample_index)`` order.

Weights. With ``share_weights=True`` (default) the engine holds a *reference* to the model
(colocated with the trainer): it samples from the live weights, ``update_weights(model, version)``
swaps the reference and records the version, nothing is copied. With ``share_weights=False`` it
keeps its own deep copy (twice the policy's memory), stale until synced like a vLLM engine:
``load_weights`` (the full state dict) or, for a PEFT policy, ``load_adapter`` (the adapter's
weights), each with the policy version they hold. The model's train/eval flag, its
``generation_config``, the caller's tokenizer and (with a seed) the caller's RNG state are left as
they were.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from verl_core.data.tokenizer import IM_END
from verl_core.errors import ConfigError
from verl_core.models import varlen_sdpa
from verl_core.models.loading import load_causal_lm, resolve_device, torch_dtype, unwrap
from verl_core.rollout.base import Completion, FinishReason, SamplingParams
from verl_core.rollout.decode import (
    DECODE_ATTENTION,
    CompiledStep,
    Decoded,
    StopStrings,
    bucket,
    choose_decode,
    decode_loop,
    eager_step,
    forget_static_cache_length,
    reference_decode,
)
from verl_core.rollout.requests import (
    check_lengths,
    check_params,
    cut_at_stop_string,
    encode_prompts,
    left_pad,
    plan_batches,
)
from verl_core.rollout.sampler import SampleAndRecord, TokenSampler, check_prompt_keys
from verl_core.runtime.watchdog import beat
from verl_core.seeding import sample_keys

log = logging.getLogger(__name__)

DECODE_PATHS = ("auto", "loop", "compiled")


class _Request(NamedTuple):
    prompt_index: int
    sample_index: int
    ids: list[int]


class _Sample(NamedTuple):
    response_ids: list[int]
    logprobs: list[float]


# one batch: (rows, row keys, params, stop ids, pad id) → tokens and behaviour log-probs (B, T)
_DecodeFn = Callable[[list[list[int]], list[int], SamplingParams, list[int], int], Decoded]


class HFEngine:
    """:class:`~verl_core.rollout.base.RolloutEngine` on transformers ``generate``.

    ``model`` is a path / hub id (model and tokenizer are loaded) or a live ``nn.Module`` (a causal
    LM, possibly PEFT-wrapped) used in place; a live model needs its ``tokenizer``. The engine is
    single-device: ``tensor_parallel_size`` must be 1. ``max_batch_tokens`` bounds the padded size
    ``rows × (prompt + max_new_tokens)`` of one ``generate`` batch (default: no bound).
    ``share_weights``: sample from the live module (True) or from an own copy synced explicitly
    (False; see the module docstring); ``policy_version``: the version of the weights it starts with;
    ``decode``: ``auto | loop | compiled`` (see the module docstring). ``compute_dtype``: the trainer's
    (bf16 beside fp32 master weights): an own copy holds its floating parameters in it; a shared
    module generates in its own dtype (the static KV cache takes one dtype, which autocast breaks)."""

    def __init__(
        self,
        model: str | nn.Module,
        tokenizer: Any = None,
        *,
        tensor_parallel_size: int = 1,
        max_batch_size: int = 64,
        max_batch_tokens: int | None = None,
        device: str | torch.device | None = None,
        dtype: str = "float32",
        trust_remote_code: bool = False,
        share_weights: bool = True,
        policy_version: int = 0,
        decode: str = "auto",
        compute_dtype: str | None = None,
    ) -> None:
        if tensor_parallel_size != 1:
            raise ConfigError(
                f"rollout.tensor_parallel_size: got {tensor_parallel_size}, but the 'hf' engine runs on one "
                "device; use rollout.name 'vllm' for tensor parallelism"
            )
        if max_batch_size < 1:
            raise ConfigError(f"rollout.max_batch_size: expected ≥ 1, got {max_batch_size}")
        if decode not in DECODE_PATHS:
            raise ConfigError(f"rollout.decode: expected one of {', '.join(DECODE_PATHS)}, got {decode!r}")
        if isinstance(model, str):
            target = resolve_device("auto" if device is None else str(device))
            if tokenizer is None:
                tokenizer = _load_tokenizer(model, trust=trust_remote_code)
            model = load_causal_lm(model, dtype=dtype, trust_remote_code=trust_remote_code).to(target).eval()
        elif device is not None:
            model.to(device)
        if tokenizer is None:
            raise ConfigError("HFEngine: a live model needs its tokenizer (HFEngine(model, tokenizer))")
        if not share_weights:  # an own copy, frozen: it changes only through load_weights / load_adapter
            if _sharded(model):
                raise ConfigError(
                    "HFEngine(share_weights=False): the model is sharded (DTensor parameters); build the "
                    "engine from the unsharded policy, before the training strategy shards it"
                )
            model = copy.deepcopy(model).eval().requires_grad_(False)
            for p in model.parameters():  # (quantized weights are not floating: they stay)
                if compute_dtype is not None and p.is_floating_point():
                    p.data = p.data.to(torch_dtype(compute_dtype))
        self.model: nn.Module = model
        self.shares_weights = share_weights
        self._version = policy_version
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.decode, reason = choose_decode(decode, _device(model), _static_cache_ok(model))
        log.info("HFEngine decode path on %s: %s (%s)", _device(model), self.decode, reason)
        self.compiled_step: CompiledStep | None = None
        if self.decode == "compiled":
            cuda = _device(model).type == "cuda"
            self.compiled_step = CompiledStep("reduce-overhead" if cuda else "default")
        self._caches: dict[tuple[int, int], Any] = {}  # compiled path: one static cache per bucket, reused

    # -- RolloutEngine ----------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The policy version of the weights this engine samples from."""
        return self._version

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        return self._generate(prompts, params, prompt_keys, self._decode_loop)

    def generate_reference(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        """:meth:`generate` with every batch decoded by transformers ``generate`` (greedy, the sampler
        as its logits processor: :func:`~verl_core.rollout.decode.reference_decode`): the readable
        reference the engine's decode paths must match token for token. Tests and
        ``benchmarks/rollout.py`` call it; no config value selects it."""
        return self._generate(prompts, params, prompt_keys, self._decode_reference)

    def _generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None,
        prompt_keys: Sequence[int] | None,
        decode: _DecodeFn,
    ) -> list[Completion]:
        params = params or SamplingParams()
        check_params(params)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        check_lengths(prompt_ids, params.max_new_tokens, _max_positions(self.model))
        pkeys = check_prompt_keys(prompt_keys, len(prompt_ids))
        requests = [
            _Request(i, j, ids) for i, ids in enumerate(prompt_ids) for j in range(params.n)
        ]  # (prompt_index, sample_index) order
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        row_keys = sample_keys(
            seed, [pkeys[r.prompt_index] for r in requests], [r.sample_index for r in requests]
        )
        batches = plan_batches(
            [len(r.ids) for r in requests], params.max_new_tokens, self.max_batch_size, self.max_batch_tokens
        )
        stop_ids = self._stop_token_ids(params)
        samples: dict[int, _Sample] = {}
        with _generation_mode(self.model):
            tokens = 0
            for batch in batches:
                rows = [requests[k].ids for k in batch]
                keys = [row_keys[k] for k in batch]
                decoded = self._generate_batch(decode, rows, keys, params, stop_ids)
                for k, sample in zip(batch, decoded, strict=True):
                    samples[k] = sample
                    tokens += len(sample.response_ids)
                beat(sequences=f"{len(samples)}/{len(requests)}", generated_tokens=tokens)
        return [self._completion(r, samples[k], params, stop_ids) for k, r in enumerate(requests)]

    def update_weights(self, model: nn.Module, version: int | None = None) -> None:
        """Sample from ``model``'s current weights, of policy ``version`` (default: the held version
        + 1). Sharing: ``model`` itself from now on (a reference swap); own copy: its weights are
        copied in (one process only: a sharded trainer syncs with :meth:`load_weights`)."""
        version = self._version + 1 if version is None else version
        if self.shares_weights:
            self.model, self._version = model, version
        elif hasattr(model, "peft_config"):
            from peft import get_peft_model_state_dict

            self.load_adapter(get_peft_model_state_dict(model), version)
        else:
            self.load_weights(model.state_dict().items(), version)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy the full weights ``(name, tensor)`` (the names of the engine model's ``state_dict``,
        every one of them) into the engine's own model; it then holds policy ``version``."""
        self._check_own_copy("load_weights")
        state = dict(weights)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"load_weights(version {version}): the weights do not match the engine's model "
                f"(missing: {sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]})"
            )
        self._version = version

    def load_adapter(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Load a LoRA adapter's weights (PEFT's saved names, ``get_peft_model_state_dict``) into the
        engine's own PEFT model; it then holds policy ``version``."""
        self._check_own_copy("load_adapter")
        if not hasattr(self.model, "peft_config"):
            raise ValueError("load_adapter: the engine's model has no LoRA adapter (use load_weights)")
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, dict(weights))
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"load_adapter(version {version}): unexpected keys {sorted(unexpected)[:5]}")
        self._version = version

    def sleep(self) -> None:
        """Frees the compiled path's KV caches; the weights are the trainer's (or kept, own copy)."""
        self._caches.clear()

    def wake_up(self) -> None:
        """Nothing to restore (see :meth:`sleep`)."""

    def close(self) -> None:
        """Nothing beyond this process's memory to release."""

    # -- helpers ------------------------------------------------------------------------------------

    def _check_own_copy(self, what: str) -> None:
        if self.shares_weights:
            raise ValueError(
                f"{what}: this engine shares the trainer's live module (share_weights=True); "
                "use update_weights(model, version)"
            )

    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        """eos, ``<|im_end|>`` when the tokenizer has it, and ``params.stop_token_ids``."""
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        im_end = self.tokenizer.get_vocab().get(IM_END)
        if im_end is not None:
            ids.append(int(im_end))
        ids.extend(int(t) for t in params.stop_token_ids)
        return list(dict.fromkeys(ids))

    def _generate_batch(
        self,
        decode: _DecodeFn,
        rows: list[list[int]],
        keys: list[int],
        params: SamplingParams,
        stop_ids: list[int],
    ) -> list[_Sample]:
        """Sample one batch with ``decode``, row b with the uniforms of ``keys[b]``; returns each row's
        generated tokens (pad included, uncut) and their behaviour log-probs."""
        pad_id = self.tokenizer.pad_token_id
        pad_id = stop_ids[0] if pad_id is None else int(pad_id)
        tokens, logprobs = decode(rows, keys, params, stop_ids, pad_id)
        return [_Sample(t, lp) for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)]

    def _decode_loop(
        self, rows: list[list[int]], keys: list[int], params: SamplingParams, stop_ids: list[int], pad_id: int
    ) -> Decoded:
        """The own loop (:func:`decode_loop`); compiled: batch and cache length padded to their buckets
        (extra rows: one pad token, done from the start) and the bucket's cache reused."""
        from transformers import DynamicCache, StaticCache

        n_real, width = len(rows), max(len(r) for r in rows)
        batch, cache_len = n_real, width + params.max_new_tokens
        if self.compiled_step is not None:
            batch = bucket(n_real, 8, self.max_batch_size)
            cache_len = bucket(cache_len, 64, _max_positions(self.model))
            rows = rows + [[pad_id]] * (batch - n_real)
            keys = keys + [0] * (batch - n_real)
        input_ids, attention_mask = left_pad(rows, pad_id, _device(self.model))  # (B, P)
        config = unwrap(self.model).config
        if not _static_cache_ok(self.model):
            cache: Any = DynamicCache(config=config)
        elif self.compiled_step is None:
            cache = StaticCache(config=config, max_cache_len=cache_len)
        else:
            cache = self._caches.get((batch, cache_len))
            if cache is None:
                cache = self._caches[batch, cache_len] = StaticCache(config=config, max_cache_len=cache_len)
            cache.reset()
        out = decode_loop(
            self.model,
            input_ids,
            attention_mask,
            cache,
            TokenSampler(params, torch.tensor(keys, dtype=torch.long, device=input_ids.device)),
            params.max_new_tokens,
            stop_ids,
            pad_id,
            stop_strings=StopStrings(self.tokenizer, params.stop) if any(params.stop) else None,
            step=self.compiled_step or eager_step,
            cache_len=cache_len if isinstance(cache, StaticCache) else None,
            rows=n_real,
            compact=self.compiled_step is None,  # a compiled step keeps its batch shape
        )
        return Decoded(out.tokens[:n_real], out.logprobs[:n_real])

    def _decode_reference(
        self, rows: list[list[int]], keys: list[int], params: SamplingParams, stop_ids: list[int], pad_id: int
    ) -> Decoded:
        """:func:`reference_decode` of the left-padded rows."""
        input_ids, attention_mask = left_pad(rows, pad_id, _device(self.model))  # (B, P)
        recorder = SampleAndRecord(params, torch.tensor(keys, dtype=torch.long, device=input_ids.device))
        stop = StopStrings(self.tokenizer, params.stop) if any(params.stop) else None
        return reference_decode(
            self.model,
            input_ids,
            attention_mask,
            recorder,
            params.max_new_tokens,
            stop_ids,
            pad_id,
            stop_strings=stop,
            static_cache=_static_cache_ok(self.model),
        )

    def _completion(
        self, request: _Request, sample: _Sample, params: SamplingParams, stop_ids: list[int]
    ) -> Completion:
        ids, logprobs = sample
        finish: FinishReason = "length"
        stops = set(stop_ids)
        end = next((t + 1 for t, tok in enumerate(ids) if tok in stops), None)
        if end is not None:
            ids, finish = ids[:end], "stop"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = cut_at_stop_string(self.tokenizer, ids, params.stop) if any(params.stop) else None
        if cut is not None:
            ids, text, finish = ids[: cut[0]], cut[1], "stop"
        return Completion(
            prompt_index=request.prompt_index,
            sample_index=request.sample_index,
            prompt_ids=list(request.ids),
            response_ids=ids,
            response_text=text,
            logprobs=logprobs[: len(ids)],
            finish_reason=finish,
        )


# -- context managers and checks ------------------------------------------------------------------------


@contextmanager
def _generation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode, no autograd and a neutral ``generation_config`` (no hub defaults such as top_k=50 or a
    repetition penalty) for the duration of generation; mode and config restored afterwards."""
    from transformers import GenerationConfig

    base = unwrap(model)
    training, saved_config = model.training, getattr(base, "generation_config", None)
    saved_attention = base.config._attn_implementation
    model.eval()
    base.generation_config = GenerationConfig()
    if saved_attention in ("sdpa", varlen_sdpa.NAME):  # outside packed calls both are transformers' sdpa
        base.set_attn_implementation(DECODE_ATTENTION)  # the same, with a cheaper CPU decode step
    try:
        with torch.no_grad():
            yield
    finally:
        forget_static_cache_length(model)
        base.generation_config = saved_config
        if base.config._attn_implementation != saved_attention:
            base.set_attn_implementation(saved_attention)
        model.train(training)


def _max_positions(model: nn.Module) -> int | None:
    value = getattr(unwrap(model).config, "max_position_embeddings", None)
    return int(value) if value is not None else None


def _static_cache_ok(model: nn.Module) -> bool:
    """Models that declare full-graph compilability (Qwen2, Llama, ...) support transformers' StaticCache."""
    return bool(getattr(unwrap(model), "_can_compile_fullgraph", False))


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _load_tokenizer(path: str, trust: bool) -> Any:
    from verl_core.data.tokenizer import load_pretrained_tokenizer, load_tokenizer_from_files

    if os.path.isdir(path):
        return load_tokenizer_from_files(path)  # respects tokenizer.json ids (not Qwen2Tokenizer's re-split)
    return load_pretrained_tokenizer(path, trust_remote_code=trust)
