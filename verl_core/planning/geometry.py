"""A decoder's geometry and parameter counts from the config alone (no weights are built).

Counts for a Qwen2 / Llama decoder of hidden ``h``, ``L`` layers, ``H`` query and ``K`` key/value heads
of dim ``d_h``, MLP width ``I`` and ``V`` embedding rows:

* per layer: attention ``h·H·d_h`` (q) + ``2·h·K·d_h`` (k, v) + ``H·d_h·h`` (o), plus the q/k/v biases
  ``(H + 2K)·d_h`` (Qwen2 only); SwiGLU MLP ``3·h·I``; two RMSNorm weights ``2·h``;
* embedding ``V·h``, final norm ``h``, and an untied LM head ``V·h`` more.

Qwen2.5-0.5B (h 896, 24 layers, 14/2 heads of 64, I 4864, V 151,936, tied): per layer 14,912,384,
embedding 136,134,656, total 494,032,768 (its published size).

``matmul_params`` is the ``N`` of FLOP counts (``2·N`` per token forward): every projection and the LM
head (a tied head is one matmul over the embedding's weights), not the embedding lookup or the norms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from verl_core.config.model import ModelConfig
from verl_core.errors import ConfigError
from verl_core.models.loading import ScratchSpec, scratch_config

_QKV_BIAS = {"qwen2": True, "llama": False}


@dataclass(frozen=True)
class Geometry:
    """Sizes of a decoder-only LM."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_rows: int
    tied_embeddings: bool = True
    qkv_bias: bool = True

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer (attention, MLP, two norms)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        bias = (self.num_heads + 2 * self.num_kv_heads) * d if self.qkv_bias else 0
        return attn + bias + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_rows * self.hidden_size

    @property
    def n_params(self) -> int:
        """Every parameter, a tied LM head counted once."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.num_layers * self.layer_params + self.embedding_params + self.hidden_size + head

    @property
    def matmul_params(self) -> int:
        """``N``: the weights every token multiplies through, forward (projections, MLP, LM head)."""
        h, d = self.hidden_size, self.head_dim
        per_layer = (
            h * self.num_heads * d
            + 2 * h * self.num_kv_heads * d
            + self.num_heads * d * h
            + 3 * h * self.intermediate_size
        )
        return self.num_layers * per_layer + self.embedding_params

    @property
    def attention_width(self) -> int:
        """``H·d_h``: the width of the attention scores' and values' matmuls."""
        return self.num_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache elements per token (keys and values of every layer); times the cache dtype's size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def lora_params(self, rank: int) -> int:
        """Adapter weights of LoRA rank ``rank`` on every projection of every layer (``all-linear``:
        q, k, v, o, gate, up, down; ``r·(in + out)`` each)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_heads * d, self.num_kv_heads * d
        per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
        return rank * per_layer * self.num_layers


def from_hf_config(config: Any) -> Geometry:
    """The geometry of an HF config object (or its ``config.json`` as a dict)."""

    def get(key: str, default: Any = None) -> Any:
        return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

    arch = str(get("model_type", "qwen2"))
    heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    return Geometry(
        architecture=arch,
        hidden_size=hidden,
        num_layers=int(get("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads", None) or heads),
        head_dim=int(get("head_dim", None) or hidden // heads),
        intermediate_size=int(get("intermediate_size")),
        vocab_rows=int(get("vocab_size")),
        tied_embeddings=bool(get("tie_word_embeddings", False)),
        qkv_bias=bool(get("attention_bias", _QKV_BIAS.get(arch, False))),
    )


def geometry_of(model: ModelConfig) -> Geometry:
    """The geometry ``model`` will build: ``init=scratch`` from its sizes (``V`` = ``vocab_pad_to``
    when set, else ``vocab_size``, the trained tokenizer's upper bound); ``init=pretrained`` from the
    ``config.json`` of a local ``model.path`` (a hub id is read through transformers' cache).

    Raises :class:`ConfigError` naming ``model.path`` when a pretrained config cannot be read."""
    if model.init == "scratch":  # the HF config the policy builder makes, at the largest vocabulary
        spec = ScratchSpec(**{f.name: getattr(model, f.name) for f in fields(ScratchSpec)})
        rows = max(model.vocab_size, model.vocab_pad_to or 0)
        return from_hf_config(scratch_config(spec, rows, eos_token_id=0, pad_token_id=0))
    path = Path(str(model.path))
    if (path / "config.json").is_file():
        return from_hf_config(json.loads((path / "config.json").read_text()))
    try:
        from transformers import AutoConfig

        return from_hf_config(
            AutoConfig.from_pretrained(str(model.path), trust_remote_code=model.trust_remote_code)
        )
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model.path: {model.path!r}: cannot read its config.json to plan the run ({e})"
        ) from None
