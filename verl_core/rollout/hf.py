"""Rollouts with transformers ``generate`` (KV cache), for CPU runs and single-GPU colocated training.

How a ``generate(prompts, params)`` call runs:
1. prompts → token ids (strings are encoded as-is, ``add_special_tokens=False``), checked against
   ``max_position_embeddings``;
2. each prompt repeated ``n`` times → requests ``(prompt_index, sample_index, ids)``;
3. requests sorted by prompt length and cut into batches of at most ``max_batch_size`` sequences and
   ``max_batch_tokens`` padded tokens (bucketing: little left padding inside a batch);
4. each batch left-padded and decoded by one of three paths (``decode``), all drawing through the
   one sampler (:class:`~verl_core.rollout.sampler.TokenSampler`: records the behaviour log-probs,
   applies temperature / top-k / top-p, draws the token with the row's own uniform at each step, a
   hash of (row key, step) where row key = ``derive_seed("sample", seed, prompt_key, sample_index)``,
   :func:`verl_core.seeding.counter_uniforms`): a row draws the same tokens whatever batch, call or
   rank it is generated in, so a rollout split over ranks (each passing its prompts' ``prompt_keys``)
   samples exactly what one process does. The paths:
   - ``loop``: the engine's own loop over a static KV cache (:func:`verl_core.rollout.decode.decode_loop`),
     eager; the CPU default (the fastest measured there, see ``benchmarks/rollout.py``);
   - ``compiled``: the same loop with the decode step compiled into CUDA graphs, batch and cache
     length bucketed to powers of two (:class:`~verl_core.rollout.decode.CompiledStep`); the CUDA
     default; elsewhere, or when compiling fails, it runs eager and logs why;
   - ``generate``: transformers ``model.generate`` in greedy mode with the sampler as its only
     logits processor (:class:`~verl_core.rollout.sampler.SampleAndRecord`): the reference the
     other two are tested against (same tokens);
   ``auto`` picks ``compiled`` on CUDA, ``loop`` elsewhere; the choice is logged once per engine;
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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor, nn

from verl_core.data.tokenizer import IM_END
from verl_core.errors import ConfigError
from verl_core.models import attention
from verl_core.models.loading import load_causal_lm, resolve_device, unwrap
from verl_core.rollout.base import Completion, FinishReason, SamplingParams
from verl_core.rollout.decode import (
    DECODE_ATTENTION,
    CompiledStep,
    StopStrings,
    bucket,
    decode_loop,
    eager_step,
)
from verl_core.rollout.sampler import SampleAndRecord, TokenSampler, check_prompt_keys
from verl_core.runtime.watchdog import beat
from verl_core.seeding import sample_keys

log = logging.getLogger(__name__)

DECODE_PATHS = ("auto", "loop", "compiled", "generate")


class _Request(NamedTuple):
    prompt_index: int
    sample_index: int
    ids: list[int]


class _Sample(NamedTuple):
    response_ids: list[int]
    logprobs: list[float]


class HFEngine:
    """:class:`~verl_core.rollout.base.RolloutEngine` on transformers ``generate``.

    ``model`` is a path / hub id (model and tokenizer are loaded) or a live ``nn.Module`` (a causal
    LM, possibly PEFT-wrapped) used in place; a live model needs its ``tokenizer``. The engine is
    single-device: ``tensor_parallel_size`` must be 1. ``max_batch_tokens`` bounds the padded size
    ``rows × (prompt + max_new_tokens)`` of one ``generate`` batch (default: no bound).
    ``share_weights``: sample from the live module (True) or from an own copy synced explicitly
    (False; see the module docstring); ``policy_version``: the version of the weights it starts with;
    ``decode``: ``auto | loop | compiled | generate`` (see the module docstring)."""

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
        params = params or SamplingParams()
        _check_params(params)
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        _check_lengths(prompt_ids, params.max_new_tokens, _max_positions(self.model))
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
                for k, sample in zip(batch, self._generate_batch(rows, keys, params, stop_ids), strict=True):
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
        self, rows: list[list[int]], keys: list[int], params: SamplingParams, stop_ids: list[int]
    ) -> list[_Sample]:
        """Sample one batch, row b with the uniforms of ``keys[b]``; returns each row's generated
        tokens (pad included, uncut) and their behaviour log-probs."""
        pad_id = self.tokenizer.pad_token_id
        pad_id = stop_ids[0] if pad_id is None else int(pad_id)
        if self.decode == "generate":
            tokens, logprobs = self._decode_generate(rows, keys, params, stop_ids, pad_id)
        else:
            tokens, logprobs = self._decode_loop(rows, keys, params, stop_ids, pad_id)
        return [_Sample(t, lp) for t, lp in zip(tokens.tolist(), logprobs.tolist(), strict=True)]

    def _decode_loop(
        self, rows: list[list[int]], keys: list[int], params: SamplingParams, stop_ids: list[int], pad_id: int
    ) -> tuple[Tensor, Tensor]:
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
        return out.tokens[:n_real], out.logprobs[:n_real]

    def _decode_generate(
        self, rows: list[list[int]], keys: list[int], params: SamplingParams, stop_ids: list[int], pad_id: int
    ) -> tuple[Tensor, Tensor]:
        """The reference path: ``model.generate`` in greedy mode, the sampler as its logits processor."""
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        input_ids, attention_mask = left_pad(rows, pad_id, _device(self.model))  # (B, P)
        recorder = SampleAndRecord(params, torch.tensor(keys, dtype=torch.long, device=input_ids.device))
        criteria = StoppingCriteriaList()
        if any(params.stop):
            stop = StopStrings(self.tokenizer, params.stop)
            criteria.append(_StopStringCriterion(stop, input_ids.shape[1]))
        config = GenerationConfig(
            do_sample=False,  # `recorder` samples; generate takes the argmax of what it returns
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=pad_id,
            use_cache=True,
            cache_implementation="static" if _static_cache_ok(self.model) else None,
            disable_compile=True,
            return_dict_in_generate=True,
        )
        _forget_static_cache_length(self.model)
        out = self.model.generate(  # type: ignore[operator]
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder]),
            stopping_criteria=criteria,
        )
        tokens = out.sequences[:, input_ids.shape[1] :]  # (B, T_new)
        return tokens, recorder.finish(tokens)  # (B, T_new) each

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


# -- pieces (free functions, tested on their own) ---------------------------------------------------


def encode_prompts(tokenizer: Any, prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Strings → ids with ``add_special_tokens=False`` (templated already); id lists pass through."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = list(tokenizer.encode(p, add_special_tokens=False))
        else:
            ids = [int(t) for t in cast("Sequence[int]", p)]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        out.append(ids)
    return out


def plan_batches(
    lengths: Sequence[int], max_new_tokens: int, max_batch_size: int, max_batch_tokens: int | None = None
) -> list[list[int]]:
    """Indices of requests grouped into generate batches, shortest prompts first.

    A batch holds at most ``max_batch_size`` rows and, when ``max_batch_tokens`` is set, at most that
    many padded tokens ``rows × (longest prompt + max_new_tokens)`` (a single row always fits)."""
    order = sorted(range(len(lengths)), key=lambda k: (lengths[k], k))
    batches: list[list[int]] = []
    current: list[int] = []
    for k in order:
        rows = len(current) + 1
        padded = rows * (lengths[k] + max_new_tokens)  # sorted: request k is the longest so far
        if current and (
            rows > max_batch_size or (max_batch_tokens is not None and padded > max_batch_tokens)
        ):
            batches.append(current)
            current = []
        current.append(k)
    if current:
        batches.append(current)
    return batches


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(input_ids (B, P), attention_mask (B, P))`` with each row right-aligned (left padding)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[b, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def cut_at_stop_string(tokenizer: Any, ids: Sequence[int], stop: Sequence[str]) -> tuple[int, str] | None:
    """The first stop-string match in the decoded response: ``(tokens to keep, text)``, or None.

    Tokens are kept up to and including the one that completes the match; the text ends right after
    the matched stop string (text decoded without special tokens)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    ends = [text.find(s) + len(s) for s in stop if s and s in text]
    if not ends:
        return None

    def matched(m: int) -> bool:
        prefix = tokenizer.decode(list(ids[:m]), skip_special_tokens=True)
        return any(s and s in prefix for s in stop)

    lo, hi = 1, len(ids)  # smallest m with matched(m): matched is monotone in m
    while lo < hi:
        mid = (lo + hi) // 2
        if matched(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo, text[: min(ends)]


class _StopStringCriterion:
    """:class:`StopStrings` as a ``generate`` stopping criterion (the reference path)."""

    def __init__(self, stop: StopStrings, prompt_width: int) -> None:
        self.stop, self.prompt_width = stop, prompt_width

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        return self.stop(input_ids[:, self.prompt_width :])


def choose_decode(decode: str, device: torch.device, static_cache: bool) -> tuple[str, str]:
    """The decode path for ``decode`` on ``device``, and why: ``auto`` → ``compiled`` on CUDA (with a
    static cache), ``loop`` elsewhere (a CPU compile costs about a minute per shape: asked for only);
    ``compiled`` without a static cache → ``loop``, logged."""
    if decode == "generate":
        return decode, "asked for: transformers generate, the reference path"
    if decode == "compiled" and not static_cache:
        log.warning("rollout.decode=compiled falls back to the eager loop: the model has no static KV cache")
        return "loop", "compiled asked for, but the model has no static KV cache: eager loop"
    if decode == "compiled" or (decode == "auto" and device.type == "cuda" and static_cache):
        graphs = "CUDA graphs" if device.type == "cuda" else "inductor, no CUDA graphs"
        return "compiled", f"{decode}: compiled decode step ({graphs}) over a static KV cache"
    return "loop", f"{decode}: own eager loop over a {'static' if static_cache else 'dynamic'} KV cache"


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
    if saved_attention in ("sdpa", attention.NAME):  # outside packed calls both are transformers' sdpa
        base.set_attn_implementation(DECODE_ATTENTION)  # the same, with a cheaper CPU decode step
    try:
        with torch.no_grad():
            yield
    finally:
        _forget_static_cache_length(model)
        base.generation_config = saved_config
        if base.config._attn_implementation != saved_attention:
            base.set_attn_implementation(saved_attention)
        model.train(training)


def _check_params(params: SamplingParams) -> None:
    if params.n < 1:
        raise ConfigError(f"rollout.n: expected ≥ 1, got {params.n}")
    if params.temperature < 0:
        raise ConfigError(f"rollout.temperature: expected ≥ 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ConfigError(f"rollout.top_p: expected in (0, 1], got {params.top_p}")
    if params.max_new_tokens < 1:
        raise ConfigError(f"rollout.max_new_tokens: expected ≥ 1, got {params.max_new_tokens}")


def _check_lengths(prompt_ids: list[list[int]], max_new_tokens: int, max_positions: int | None) -> None:
    if max_positions is None:
        return
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_new_tokens > max_positions:
            raise ConfigError(
                f"prompt {i}: {len(ids)} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
                f"max_position_embeddings ({max_positions}); shorten the prompt or lower max_new_tokens"
            )


def _max_positions(model: nn.Module) -> int | None:
    value = getattr(unwrap(model).config, "max_position_embeddings", None)
    return int(value) if value is not None else None


def _static_cache_ok(model: nn.Module) -> bool:
    """Models that declare full-graph compilability (Qwen2, Llama, ...) support transformers' StaticCache."""
    return bool(getattr(unwrap(model), "_can_compile_fullgraph", False))


def _forget_static_cache_length(model: nn.Module) -> None:
    """transformers sizes a static cache for the longest of all generate calls so far (it avoids
    recompiling); without compilation that only costs time, so each batch gets its own size."""
    base = unwrap(model)
    if hasattr(base, "_previous_max_cache_length"):
        del base._previous_max_cache_length


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _load_tokenizer(path: str, trust: bool) -> Any:
    from verl_core.data.tokenizer import load_pretrained_tokenizer, load_tokenizer_from_files

    if os.path.isdir(path):
        return load_tokenizer_from_files(path)  # respects tokenizer.json ids (STACK_NOTES)
    return load_pretrained_tokenizer(path, trust_remote_code=trust)
