"""Packed ("remove padding") forward passes and chunked log-probs / entropies.

Sequences are concatenated into one row without padding: ``input_ids (N,)`` with per-sequence
``position_ids (N,)`` that restart at 0, and ``cu_seqlens (S+1,)`` offsets. The HF decoder is called
with ``position_ids`` and ``use_cache=False``; models switched to ``varlen_sdpa`` get a
:class:`~verl_core.models.varlen_sdpa.PackedLayout` and run the packed attention backend it selects
(:mod:`verl_core.models.attention`), flash-attn models their varlen kernel, others (eager) the
block-diagonal mask transformers derives from the position ids. With a KV cache present transformers
silently does *not* restrict attention to each sequence (it builds the packed mask from the position
ids only without a cache), which is why
``use_cache=False`` is forced here and covered by a test. ``cu_seqlens`` is read on the host once per
forward (:func:`packed_inputs`); no layer synchronises.

Log-probs and entropies come from the final hidden states in chunks of tokens: each chunk's logits
``(chunk, V)`` are computed, reduced and freed; under autograd, when the whole ``(N, V)`` float32
logits would be large, each chunk is checkpointed and recomputed in backward so they never exist at once.
A chunk holds at most :data:`_CHUNK_LOGITS_ELEMENTS` logits (:func:`logits_chunk_tokens`): at a real
vocabulary (Qwen2.5: 151,936) 1,024 tokens would be 594 MiB of float32 logits per buffer, and the
log-softmax, entropy and backward each need a few such buffers at once.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from verl_core.models import lm_head, varlen_sdpa
from verl_core.models.attention import SharedPrompts, take
from verl_core.models.loading import unwrap


class TokenLogProbs(NamedTuple):
    log_probs: Tensor  # (N,) log p(target_t | tokens ≤ t)
    entropy: Tensor | None  # (N,) entropy of p(· | tokens ≤ t), or None when not asked for


def position_ids_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """``cu_seqlens (S+1,)`` → ``position_ids (N,)`` restarting at 0 for every sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)  # (N,)
    return torch.arange(int(cu_seqlens[-1]), device=cu_seqlens.device) - starts


def next_token_targets(input_ids: Tensor, cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """Targets for next-token prediction inside each packed sequence.

    ``targets[t] = input_ids[t+1]`` unless ``t`` is the last token of its sequence, where there is no
    target (``has_target[t] = False``, ``targets[t] = 0``). Returns ``(targets (N,), has_target (N,))``."""
    n = input_ids.shape[0]
    targets = torch.zeros_like(input_ids)
    targets[:-1] = input_ids[1:]
    has_target = torch.ones(n, dtype=torch.bool, device=input_ids.device)
    last = cu_seqlens[1:].long() - 1  # (S,) index of each sequence's last token
    has_target[last] = False
    targets[last] = 0
    return targets, has_target


def varlen_kwargs(
    model: nn.Module,
    cu_seqlens: list[int],
    device: torch.device,
    attention: str = "auto",
    shared: SharedPrompts | None = None,
) -> dict[str, Any]:
    """Keyword arguments that make a decoder attend within each packed sequence.

    With ``varlen_sdpa`` (see :mod:`verl_core.models.varlen_sdpa`): a ``PackedLayout`` whose backend
    (``attention``: a ``PACKED_ATTENTION`` name or ``auto``) every layer runs, and a 1-element
    placeholder 4-D mask that transformers passes through as-is instead of building an N×N mask that
    would be ignored. With flash-attn: the sequence offsets. Otherwise nothing: transformers
    derives the block-diagonal mask from the position ids."""
    impl = unwrap(model).config._attn_implementation
    if impl == varlen_sdpa.NAME:
        return {
            "packed_layout": varlen_sdpa.PackedLayout(cu_seqlens, attention, shared),
            "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
        }
    if shared is not None:
        raise ValueError(f"shared prompts need attn_implementation sdpa (varlen_sdpa), not {impl!r}")
    if impl not in ("flash_attention_2", "flash_attention_3"):
        return {}
    max_len = max((b - a for a, b in itertools.pairwise(cu_seqlens)), default=0)
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def shared_prompts_for(model: nn.Module, shared: SharedPrompts | None) -> SharedPrompts | None:
    """``shared`` where ``model``'s packed forwards can store prompts once (:class:`SharedPrompts`):
    models on ``varlen_sdpa``; None for the others, which compute every sequence in full (same
    results)."""
    return shared if unwrap(model).config._attn_implementation == varlen_sdpa.NAME else None


def use_varlen_attention(model: nn.Module) -> None:
    """Switch an ``sdpa`` model to ``varlen_sdpa`` (identical outside packed calls)."""
    base = unwrap(model)
    if base.config._attn_implementation == "sdpa":
        base.set_attn_implementation(varlen_sdpa.NAME)


def packed_inputs(
    model: nn.Module,
    input_ids: Tensor,
    cu_seqlens: Tensor,
    attention: str = "auto",
    shared: SharedPrompts | None = None,
) -> dict[str, Any]:
    """Keyword arguments of a packed decoder call for ``input_ids (T,)``, ``cu_seqlens (S+1,)``:
    ``input_ids``/``position_ids (1, T)``, ``use_cache=False`` and :func:`varlen_kwargs`; with
    ``shared`` prompts the N stored tokens ``input_ids[shared.unique]`` and their positions. Reads
    ``cu_seqlens`` on the host once: the only host synchronisation of a packed forward."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    position_ids = position_ids_from_cu_seqlens(torch.tensor(cu, dtype=torch.long))  # (T,), on the host
    position_ids = position_ids.to(input_ids.device, non_blocking=True)
    if shared is not None:
        input_ids, position_ids = input_ids[shared.unique], position_ids[shared.unique]  # (N,)
    return {
        "input_ids": input_ids[None],
        "position_ids": position_ids[None],
        "use_cache": False,
        **varlen_kwargs(model, cu, input_ids.device, attention, shared),
    }


def packed_hidden_states(
    model: nn.Module,
    input_ids: Tensor,
    cu_seqlens: Tensor,
    attention: str = "auto",
    shared: SharedPrompts | None = None,
) -> Tensor:
    """Final hidden states ``(T, H)`` of a causal LM (or its PEFT wrapper) for packed ``input_ids (T,)``;
    with ``shared`` prompts those of the N stored tokens, ``(N, H)`` (token t's is row ``expand[t]``)."""
    decoder = unwrap(model).get_decoder()
    out = decoder(**packed_inputs(model, input_ids, cu_seqlens, attention, shared))
    return out.last_hidden_state[0]


def output_head(model: nn.Module) -> tuple[Tensor, Tensor | None, float | None]:
    """``(weight (V, H), bias (V,) | None, softcap | None)`` of the LM head."""
    base = unwrap(model)
    head = base.get_output_embeddings()
    softcap = getattr(base.config, "final_logit_softcapping", None)
    return head.weight, head.bias if getattr(head, "bias", None) is not None else None, softcap


def _chunk_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    softcap: float | None,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    logits = F.linear(hidden, weight, bias).float()  # (C, V)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:  # z / 1 == z exactly: no (C, V) copy
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)  # (C,)
    log_probs = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z  # log p_y = z_y − log Z
    if not with_entropy:
        return log_probs, None
    # H(p) = −Σ_v p_v log p_v = log Z − Σ_v p_v z_v, with p_v = exp(z_v − log Z)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = log_z - (torch.exp(logits - log_z[:, None]) * logits).sum(-1)
    return log_probs, entropy


# Below this many float32 logits in the whole call (N·V; 64 Mi elements = 256 MiB) backward keeps them
# instead of recomputing each chunk (activation checkpointing would run the LM head twice).
_KEEP_LOGITS_ELEMENTS = 64 * 2**20
# The most float32 logits of one chunk (C·V; 64 Mi elements = 256 MiB): C = chunk_size up to a vocabulary
# of 65,536; at 151,936, 441 tokens (smaller chunks cost time on CPU: each one streams the whole head).
_CHUNK_LOGITS_ELEMENTS = 64 * 2**20


def logits_chunk_tokens(chunk_size: int, vocab_size: int) -> int:
    """Tokens per LM-head chunk: ``min(chunk_size, _CHUNK_LOGITS_ELEMENTS // V)``, at least 1."""
    return max(1, min(chunk_size, _CHUNK_LOGITS_ELEMENTS // vocab_size))


def chunked_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    softcap: float | None = None,
    with_entropy: bool = True,
    entropy_grad: bool = True,
) -> TokenLogProbs:
    """Per-token ``log p(targets)`` and (``with_entropy``) entropies from hidden states ``(N, H)`` and
    an LM head ``weight (V, H)``, ``chunk_size`` tokens at a time, fewer where V is large and the
    logits are not kept for backward (:func:`logits_chunk_tokens`; float32 math). Without
    ``with_entropy`` no entropy is computed at all (only log Z and the target logit); without
    ``entropy_grad`` it is computed outside autograd (a metric: nothing is saved for backward).

    When gradients are needed and the whole ``(N, V)`` float32 logits would exceed
    ``_KEEP_LOGITS_ELEMENTS``, backward recomputes each chunk's logits instead of keeping them, so peak
    memory is one chunk's ``(C, V)`` blocks: :class:`~verl_core.models.lm_head.HeadLogProbs` (one
    weight gradient accumulated in place) where it applies (``lm_head.fits``), else each chunk under
    activation checkpointing."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    recompute = grad and hidden.shape[0] * weight.shape[0] > _KEEP_LOGITS_ELEMENTS
    # kept for backward, all chunks' logits exist at once (≤ _KEEP_LOGITS_ELEMENTS): smaller chunks
    # would save nothing and cost a (V, H) weight gradient each
    kept = grad and not recompute
    chunk = chunk_size if kept else logits_chunk_tokens(chunk_size, weight.shape[0])
    if recompute and lm_head.fits(hidden, weight, bias, softcap):  # one (V, H) gradient, not one per chunk
        return TokenLogProbs(
            *lm_head.head_log_probs(
                hidden, weight, targets, bias=bias, chunk=chunk, temperature=temperature,
                with_entropy=with_entropy, entropy_grad=entropy_grad,
            )
        )  # fmt: skip
    lps, ents = [], []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        args = (h, weight, bias, t, temperature, softcap, with_entropy, entropy_grad)
        lp, ent = (
            checkpoint(_chunk_logprobs, *args, use_reentrant=False) if recompute else _chunk_logprobs(*args)
        )
        lps.append(lp)
        if ent is not None:
            ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TokenLogProbs(empty, empty if with_entropy else None)
    return TokenLogProbs(torch.cat(lps), torch.cat(ents) if with_entropy else None)


def packed_log_probs(
    model: nn.Module,
    input_ids: Tensor,
    cu_seqlens: Tensor,
    *,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    attention: str = "auto",
    positions: Tensor | None = None,
    shared: SharedPrompts | None = None,
) -> tuple[TokenLogProbs, Tensor]:
    """Packed forward + chunked next-token log-probs; ``attention`` names the packed attention backend
    (:data:`verl_core.models.attention.PACKED_ATTENTION`, or ``auto``); ``shared``: prompts stored
    once (:class:`SharedPrompts`; results as without, to float rounding; ignored where
    :func:`shared_prompts_for` says so).

    Args: ``input_ids (T,)``, ``cu_seqlens (S+1,)`` (the full sequences, also with ``shared``),
    ``positions (P,)`` (optional): the packed positions whose log-probs are wanted (e.g. those
    predicting response tokens); the LM head then runs on those P positions only (prompt logits are
    never computed). Returns ``(TokenLogProbs with (T,) tensors — (P,) with positions —, has_target
    (T,) | (P,) bool)``: position ``t`` holds
    ``log p(input_ids[t+1] | input_ids[..t])`` of its own sequence, and is meaningless (``has_target``
    False) at each sequence's last token."""
    shared = shared_prompts_for(model, shared)
    hidden = packed_hidden_states(model, input_ids, cu_seqlens, attention, shared)  # (T | N, H)
    weight, bias, softcap = output_head(model)
    targets, has_target = next_token_targets(input_ids, cu_seqlens)
    if positions is not None:
        targets, has_target = targets[positions], has_target[positions]  # (P,)
    if shared is not None:  # stored row of each wanted position
        positions = shared.expand if positions is None else shared.expand[positions]
    if positions is not None:
        hidden = take(hidden, positions)  # (P, H)
    out = chunked_log_probs(
        hidden,
        weight,
        targets,
        bias=bias,
        chunk_size=chunk_size,
        temperature=temperature,
        softcap=softcap,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    return out, has_target


def packed_scores(
    model: nn.Module,
    input_ids: Tensor,
    cu_seqlens: Tensor,
    attention: str = "auto",
    shared: SharedPrompts | None = None,
) -> Tensor:
    """Per-token scalar outputs ``(T,)`` of a token/sequence classification model with one label
    (a critic's values, a reward model's scores), computed packed: backbone hidden states through
    the model's ``score`` head; ``shared`` as in :func:`packed_log_probs`."""
    base: Any = unwrap(model)
    backbone = getattr(base, base.base_model_prefix)
    shared = shared_prompts_for(model, shared)
    hidden = backbone(**packed_inputs(model, input_ids, cu_seqlens, attention, shared))
    scores = base.score(hidden.last_hidden_state[0]).squeeze(-1).float()  # (N,)
    return scores if shared is None else take(scores, shared.expand)  # (T,)


# decoder-layer class → its subclass whose packed forwards run compiled (one per class: the layers of
# a model share one compiled forward, "regional compilation")
_COMPILED_LAYER_CLASSES: dict[type, type] = {}


def _is_packed_call(kwargs: dict[str, Any]) -> bool:
    """Whether a decoder layer is called by a packed forward (:func:`varlen_kwargs`' keys)."""
    return kwargs.get("packed_layout") is not None or kwargs.get("cu_seq_lens_q") is not None


def _compiled_layer_class(cls: type) -> type:
    if cls not in _COMPILED_LAYER_CLASSES:
        eager = cls.forward  # type: ignore[attr-defined]
        compiled = torch.compile(eager, dynamic=True)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return (compiled if _is_packed_call(kwargs) else eager)(self, *args, **kwargs)

        _COMPILED_LAYER_CLASSES[cls] = type(f"PackedCompiled{cls.__name__}", (cls,), {"forward": forward})
    return _COMPILED_LAYER_CLASSES[cls]


def compile_decoder_layers(layers: nn.ModuleList) -> None:
    """``torch.compile`` each decoder layer's forward for packed forwards (training, log-probs, critic
    values), in place; every other call (generation, with its KV cache) stays eager.

    Regional compilation: one compiled forward per layer class, shared by all layers (the first
    packed forward compiles it, fwd and bwd; about 10-15 s on CPU for a small Qwen2), with a dynamic
    token count, so new lengths do not recompile. Fuses the norms, rotary embedding, SwiGLU and
    residual adds between the projections; the packed attention itself runs eager (its graph break,
    :func:`verl_core.models.varlen_sdpa.varlen_sdpa_attention`). The layers keep their parameters and
    ``state_dict`` keys; their class becomes a subclass of their own (``PackedCompiled<Layer>``), so
    copies of the model are compiled too. Fusion reorders float operations: results match the eager
    forward to float rounding, not bit for bit."""
    for layer in layers:
        if not isinstance(layer, tuple(_COMPILED_LAYER_CLASSES.values())):
            layer.__class__ = _compiled_layer_class(type(layer))


class PackedCausalLM(nn.Module):
    """A causal LM run packed ("remove padding"): ``forward(input_ids (N,), cu_seqlens (S+1,))`` →
    ``(TokenLogProbs, has_target)``, as :func:`packed_log_probs`.

    Training calls this wrapper rather than the HF model so that the wrapper is the root module:
    under FSDP2 its forward/backward hooks then gather the embedding, final norm and LM head that
    the chunked log-prob computation reads directly. ``.lm`` is the HF (or PEFT) model for saving
    and generation. ``compile_layers``: :func:`compile_decoder_layers` (packed forwards only)."""

    def __init__(
        self, lm: nn.Module, chunk_size: int = 1024, attention: str = "auto", compile_layers: bool = False
    ) -> None:
        super().__init__()
        use_varlen_attention(lm)
        self.lm = lm
        self.chunk_size = chunk_size
        self.attention = attention
        if compile_layers:
            compile_decoder_layers(self.decoder_layers())

    def forward(
        self,
        input_ids: Tensor,
        cu_seqlens: Tensor,
        temperature: float = 1.0,
        with_entropy: bool = True,
        entropy_grad: bool = True,
        positions: Tensor | None = None,
        shared: SharedPrompts | None = None,
    ) -> tuple[TokenLogProbs, Tensor]:
        return packed_log_probs(
            self.lm,
            input_ids,
            cu_seqlens,
            chunk_size=self.chunk_size,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            attention=self.attention,
            positions=positions,
            shared=shared,
        )

    def decoder_layers(self) -> nn.ModuleList:
        """The transformer blocks (the units FSDP2 shards one by one)."""
        layers: nn.ModuleList = unwrap(self.lm).get_decoder().layers
        return layers


class PackedScoreModel(nn.Module):
    """A one-label token/sequence classification model run packed: ``forward(input_ids (T,),
    cu_seqlens (S+1,), shared=None)`` → per-token scores ``(T,)`` (critic values, reward-model
    scores); ``shared`` prompts as in :func:`packed_scores`."""

    def __init__(self, model: nn.Module, attention: str = "auto", compile_layers: bool = False) -> None:
        super().__init__()
        use_varlen_attention(model)
        self.model = model
        self.attention = attention
        if compile_layers:
            compile_decoder_layers(self.decoder_layers())

    def forward(self, input_ids: Tensor, cu_seqlens: Tensor, shared: SharedPrompts | None = None) -> Tensor:
        return packed_scores(self.model, input_ids, cu_seqlens, self.attention, shared)

    def decoder_layers(self) -> nn.ModuleList:
        base: Any = unwrap(self.model)
        layers: nn.ModuleList = getattr(base, base.base_model_prefix).layers
        return layers
