"""The HF engine's own decode loop: prefill, then one cached forward per new token, no ``generate``.

``generate`` runs, per token, a chain of per-step machinery (input preparation, mask building,
logits processors, stopping criteria, a ``torch.cat`` of the ids); :func:`decode_loop` does only
what a step needs, and drops finished rows from the batch:

1. prefill (:func:`prefill`): one forward of the distinct left-padded prompts into the KV cache
   (the ``n`` samples of a prompt share it), position ids ``cumsum(mask) - 1`` (pads at 0, masked
   anyway), logits of the last position only;
2. per step t: draw token t with the :class:`~verl_core.rollout.sampler.TokenSampler` (row keys,
   step t), record its behaviour log-prob, mark rows that produced a stop token or whose text tail
   holds a stop string as done (later tokens of a done row are ``pad_id``), stop when every row is
   done or ``max_new_tokens`` are drawn; else one forward of the new tokens ``(B, 1)`` at position
   ``n_real + t`` with the cache — through ``step`` (eager, or a compiled step on CUDA:
   :class:`CompiledStep`); eager, once a quarter of the running rows are done, those rows leave
   the batch and the cache.

The tokens equal those of ``generate`` with the same sampler (:func:`reference_decode`, the
readable reference the loop is tested against), since both run the same forwards on the same inputs.
Returns tokens and log-probs ``(B, T)``, ``T ≤ max_new_tokens`` (uncut: the caller cuts at the first
stop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from verl_core.models.loading import unwrap
from verl_core.rollout.sampler import SampleAndRecord, TokenSampler

log = logging.getLogger(__name__)

# one cached forward: (model, input_ids (B, q), position_ids (B, q), attention_mask (B, L≥past+q), cache)
# → logits (B, V) of the last position, float32
StepFn = Callable[[nn.Module, Tensor, Tensor, Tensor, Any], Tensor]


def decode_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float | None
) -> Tensor:
    """Attention of one new token per row over its cached keys: ``softmax(q·kᵀ·scale + mask)·v``.

    query ``(B, H, 1, D)``, key/value ``(B, H_kv, L, D)``, mask ``(B, 1, 1, L)`` (bool, True = attend,
    or additive float) → output ``(B, 1, H, D)``. The query heads of a GQA group (heads ``g·G … g·G+G−1``
    read key head ``g``, ``G = H / H_kv``, as transformers' ``repeat_kv``) become the rows of one
    ``(G, D) × (D, L)`` product per (row, key head), so keys are never repeated."""
    b, h, _, d = query.shape
    h_kv = key.shape[1]
    scale = d**-0.5 if scaling is None else scaling
    scores = torch.matmul(query.view(b, h_kv, h // h_kv, d), key.transpose(-1, -2)) * scale  # (B, H_kv, G, L)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    else:
        scores = scores + mask.view(b, 1, 1, -1)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, value).view(b, h, 1, d).transpose(1, 2)  # (B, 1, H, D)


def decode_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention, except a decode step on CPU (one query per row, with a mask):
    :func:`decode_attention`, the same formula as two small batched matmuls, which cost less than
    sdpa's CPU kernel there (``benchmarks/rollout.py``). Registered with transformers as
    :data:`DECODE_ATTENTION`; the HF engine switches its model to it for the duration of a rollout."""
    if query.shape[2] == 1 and query.device.type == "cpu" and attention_mask is not None:
        return decode_attention(query, key, value, attention_mask, scaling), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


DECODE_ATTENTION = "verl_decode_sdpa"


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, decode_sdpa_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


_register()


def choose_decode(decode: str, device: torch.device, static_cache: bool) -> tuple[str, str]:
    """The decode path for ``decode`` on ``device``, and why: ``auto`` → ``compiled`` on CUDA (with a
    static cache), ``loop`` elsewhere (a CPU compile is slow: only when asked for);
    ``compiled`` without a static cache → ``loop``, logged."""
    if decode == "compiled" and not static_cache:
        log.warning("rollout.decode=compiled falls back to the eager loop: the model has no static KV cache")
        return "loop", "compiled asked for, but the model has no static KV cache: eager loop"
    if decode == "compiled" or (decode == "auto" and device.type == "cuda" and static_cache):
        graphs = "CUDA graphs" if device.type == "cuda" else "inductor, no CUDA graphs"
        return "compiled", f"{decode}: compiled decode step ({graphs}) over a static KV cache"
    return "loop", f"{decode}: own eager loop over a {'static' if static_cache else 'dynamic'} KV cache"


class Decoded(NamedTuple):
    """``tokens (B, T)``: drawn tokens, ``pad_id`` after a row's stop; ``logprobs (B, T)``: their
    behaviour log-probs (float32)."""

    tokens: Tensor
    logprobs: Tensor


def eager_step(model: nn.Module, ids: Tensor, positions: Tensor, mask: Tensor, cache: Any) -> Tensor:
    """One forward with the cache, logits of the last position only ``(B, V)`` float32."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


def prefill(model: nn.Module, ids: Tensor, positions: Tensor, mask: Tensor, cache: Any) -> Tensor:
    """The prompts' forward into the empty ``cache``: logits ``(B, V)`` of each row's last position.

    Rows holding the same prompt (the ``n`` samples of a prompt, identical ``ids`` and ``mask``) share
    one forward: the ``U`` distinct rows run into a dynamic cache, whose keys/values (post-RoPE, per
    layer ``(U, H_kv, P, D)``) are then repeated to all ``B`` rows and written into ``cache`` through
    its own ``update`` (static or dynamic alike). With ``n`` samples per prompt this divides the
    prefill's compute by ``n``; a row's values are those of its own forward (rows never interact)."""
    rows = torch.cat([ids, mask], dim=1)  # (B, 2P): a prompt is its ids *and* its padding
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)  # (U, 2P), (B,)
    if distinct.shape[0] == rows.shape[0]:
        return eager_step(model, ids, positions, mask, cache)
    # the first row of each distinct prompt: min over the rows b with inverse[b] == u
    first = torch.full((distinct.shape[0],), rows.shape[0], device=ids.device, dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(rows.shape[0], device=ids.device), "amin")
    from transformers import DynamicCache

    shared: Any = DynamicCache(config=unwrap(model).config)
    logits = eager_step(model, ids[first], positions[first], mask[first], shared)  # (U, V)
    for i, layer in enumerate(shared.layers):
        cache.update(layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse), i)
    return logits.index_select(0, inverse)  # (B, V)


def decode_loop(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    cache: Any,
    sampler: TokenSampler,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    stop_strings: Callable[[Tensor], Tensor] | None = None,
    step: StepFn = eager_step,
    cache_len: int | None = None,
    rows: int | None = None,
    compact: bool = False,
) -> Decoded:
    """Decode ``input_ids (B, P)`` (left-padded, ``attention_mask (B, P)``) into an empty ``cache``:
    a static one of ``cache_len ≥ P + max_new_tokens`` positions (every step then gets the whole
    ``(B, cache_len)`` mask: one shape for a compiled step) or, with ``cache_len=None``, a dynamic one
    (the mask grows by one column per step). ``stop_strings(tokens (B, t)) → (B,) bool`` flags rows
    whose generated text holds a stop string. Only the first ``rows`` rows (default all) are real:
    the others (batch padding for a compiled step) start done. ``compact`` (eager steps only: it
    changes the batch shape): once a quarter of the running rows are done, drop them from the batch
    and the cache, so finished rows cost nothing (a row's tokens do not depend on its batch).
    See the module docstring."""
    batch, width = input_ids.shape
    device = input_ids.device
    # the whole mask at once: generated positions are always attended (causality hides the future)
    extra = max_new_tokens if cache_len is None else cache_len - width
    mask = torch.cat([attention_mask, attention_mask.new_ones(batch, extra)], dim=1)  # (b, P+extra)
    positions = (attention_mask.cumsum(-1) - 1).clamp_(min=0)  # (B, P)
    next_position = positions[:, -1:] + 1  # (b, 1): n_real, the position of generated token 0
    stops = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    done = torch.arange(batch, device=device) >= (batch if rows is None else rows)  # (B,)
    live = torch.arange(batch, device=device)  # (b,) the rows in the running batch

    logits = prefill(model, input_ids, positions, attention_mask, cache)  # (b, V), never compiled
    for t in range(max_new_tokens):
        token, lp = sampler(logits, t)  # (b, 1), (b, V)
        token = token.masked_fill_(done[live].unsqueeze(-1), pad_id)  # as generate: done rows go on with pad
        tokens[live, t] = token.squeeze(-1)
        logprobs[live, t] = lp.gather(-1, token).squeeze(-1)
        done[live] |= torch.isin(token.squeeze(-1), stops)
        if stop_strings is not None:
            done[live] |= stop_strings(tokens[live, : t + 1])
        if t + 1 == max_new_tokens or bool(done.all()):
            return Decoded(tokens[:, : t + 1], logprobs[:, : t + 1])
        if compact and 4 * int(done[live].sum()) >= len(live):
            keep = (~done[live]).nonzero().squeeze(-1)  # (b',) positions in the running batch
            live, token, mask, next_position = live[keep], token[keep], mask[keep], next_position[keep]
            sampler = sampler.rows(keep)
            _keep_cache_rows(cache, keep)
        step_mask = mask if cache_len is not None else mask[:, : width + t + 1]
        logits = step(model, token, next_position + t, step_mask, cache)
    raise AssertionError("unreachable: the loop returns at its last step")


def _keep_cache_rows(cache: Any, keep: Tensor) -> None:
    """Keep batch rows ``keep (b',)`` of every layer of a transformers KV cache (static or dynamic)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, keep)
        layer.values = layer.values.index_select(0, keep)
        if hasattr(layer, "batch_size"):
            layer.batch_size = len(keep)


class CompiledStep:
    """A decode step compiled with ``torch.compile(mode=..., fullgraph=True)``, once per input shape.
    On CUDA ``mode="reduce-overhead"``: CUDA graphs replay the step's kernels without per-kernel
    launch cost; on CPU ``mode="default"`` (inductor fuses the small ops; a compile per shape is
    slow there). Shapes are ``(batch bucket, cache-length bucket)`` (see
    :func:`bucket`), so compiles stay bounded; :attr:`compiles` counts them. The 4-D attention mask
    is built outside the graph (as transformers does for its own compiled decoding). On the first
    failure it logs the reason and runs eager from then on (:attr:`fallback` holds the reason).
    torch's recompile limit (``torch._dynamo.config.recompile_limit``, 8) caps the graphs kept per
    model: past it dynamo runs the step eagerly, with its own warning."""

    def __init__(self, mode: str = "reduce-overhead") -> None:
        self.mode = mode
        self._compiled: dict[int, Callable[..., Any]] = {}  # id(model) → compiled forward (the latest model)
        self.shapes: set[tuple[int, ...]] = set()
        self.fallback: str | None = None

    @property
    def compiles(self) -> int:
        """Distinct (model, batch, cache length) graphs compiled so far."""
        return len(self.shapes)

    def __call__(self, model: nn.Module, ids: Tensor, positions: Tensor, mask: Tensor, cache: Any) -> Tensor:
        if self.fallback is not None:
            return eager_step(model, ids, positions, mask, cache)
        try:
            from transformers.masking_utils import create_masks_for_generate

            base: Any = getattr(model, "get_base_model", lambda: model)()
            mask4d = create_masks_for_generate(
                config=base.config,
                inputs_embeds=torch.empty((ids.shape[0], 1, 0), dtype=base.dtype, device=ids.device),
                attention_mask=mask,
                past_key_values=cache,
                position_ids=positions,
            )
            if id(model) not in self._compiled:
                self._compiled.clear()  # a swapped-in module (update_weights): its own graphs only
                compiled = torch.compile(model.__call__, mode=self.mode, fullgraph=True, dynamic=False)
                self._compiled[id(model)] = compiled
            self.shapes.add((id(model), ids.shape[0], mask.shape[1]))
            if self.mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            out = self._compiled[id(model)](
                input_ids=ids,
                attention_mask=mask4d,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            return out.logits[:, -1].float().clone()  # the graph's output buffer is reused next replay
        except Exception as err:  # any compile/graph failure: the eager step is always correct
            self.fallback = f"{type(err).__name__}: {err}"[:500]
            log.warning("compiled decode step failed, running eager from now on: %s", self.fallback)
            return eager_step(model, ids, positions, mask, cache)


def bucket(n: int, smallest: int, largest: int | None = None) -> int:
    """The power of two ≥ ``n`` and ≥ ``smallest``, capped at ``largest`` when that is ≥ ``n``
    (a compiled step's batch or cache length: few distinct shapes → few compiles)."""
    size = max(smallest, 1 << max(n - 1, 0).bit_length())
    return size if largest is None or largest < n else min(size, largest)


class StopStrings:
    """``(tokens (B, t)) → (B,) bool``: the text of a row's last few generated tokens contains a stop
    string (the exact cut is made afterwards by ``cut_at_stop_string``)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.window = max(len(s) for s in self.stop) + 2  # every token decodes to ≥ 1 char, or a byte part

    def __call__(self, tokens: Tensor) -> Tensor:
        texts = self.tokenizer.batch_decode(tokens[:, -self.window :].tolist(), skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stop) for t in texts], device=tokens.device)


def reference_decode(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    recorder: SampleAndRecord,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    pad_id: int,
    stop_strings: Callable[[Tensor], Tensor] | None = None,
    static_cache: bool = True,
) -> Decoded:
    """The readable reference of :func:`decode_loop`: transformers ``model.generate`` in greedy mode,
    ``recorder`` (the same sampler as a logits processor) its only logits processor, so generate's
    argmax is the sampler's draw. Same inputs and outputs as :func:`decode_loop`; tests check the loop
    (and the compiled path's bucketing) against it, ``benchmarks/rollout.py`` times it. Not a config
    choice."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    criteria = StoppingCriteriaList()
    if stop_strings is not None:
        criteria.append(_StopStringCriterion(stop_strings, input_ids.shape[1]))
    config = GenerationConfig(
        do_sample=False,  # `recorder` samples; generate takes the argmax of what it returns
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stop_ids),
        pad_token_id=pad_id,
        use_cache=True,
        cache_implementation="static" if static_cache else None,
        disable_compile=True,
        return_dict_in_generate=True,
    )
    forget_static_cache_length(model)
    out = model.generate(  # type: ignore[operator]
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=config,
        logits_processor=LogitsProcessorList([recorder]),
        stopping_criteria=criteria,
    )
    forget_static_cache_length(model)
    tokens = out.sequences[:, input_ids.shape[1] :]  # (B, T_new)
    return Decoded(tokens, recorder.finish(tokens))  # (B, T_new) each


class _StopStringCriterion:
    """A ``(tokens (B, t)) → (B,) bool`` stop-string check as a ``generate`` stopping criterion."""

    def __init__(self, stop: Callable[[Tensor], Tensor], prompt_width: int) -> None:
        self.stop, self.prompt_width = stop, prompt_width

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        return self.stop(input_ids[:, self.prompt_width :])


def forget_static_cache_length(model: nn.Module) -> None:
    """transformers sizes a static cache for the longest of all generate calls so far (it avoids
    recompiling); without compilation that only costs time, so each batch gets its own size."""
    base = unwrap(model)
    if hasattr(base, "_previous_max_cache_length"):
        del base._previous_max_cache_length
