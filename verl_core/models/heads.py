"""Critic (value model) and reward model: one scalar per token / per sequence.

Value model: ``AutoModelForTokenClassification`` with one label and no dropout (HF's default classifier
dropout of 0.1 would make values noisy), initialised from the policy's backbone or from its own path.
Reward model: ``AutoModelForSequenceClassification`` with one label, scored at each sequence's last
token. Both are run packed through :func:`verl_core.models.packed.packed_scores`.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from verl_core.errors import VerlFlowError
from verl_core.models.loading import ModelLoadError, own_memory, torch_dtype, unwrap
from verl_core.models.packed import packed_scores


def value_model_from_policy(policy: nn.Module, *, seed: int) -> nn.Module:
    """A value model whose backbone is a copy of ``policy``'s decoder weights and whose scalar head is
    freshly initialised (deterministic for ``seed``). LoRA policies contribute their base weights."""
    from transformers import AutoModelForTokenClassification

    base: Any = unwrap(policy)
    config = copy.deepcopy(base.config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.use_cache = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = AutoModelForTokenClassification.from_config(
            config, attn_implementation=config._attn_implementation, dtype=base.dtype
        )
    decoder_state = {k: v for k, v in base.get_decoder().state_dict().items() if "lora_" not in k}
    decoder_state = {k.replace("base_layer.", ""): v for k, v in decoder_state.items()}
    missing, unexpected = getattr(critic, critic.base_model_prefix).load_state_dict(
        decoder_state, strict=False
    )
    if missing or unexpected:
        raise VerlFlowError(
            f"critic init from the policy failed: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return critic


def load_value_model(path: str, *, dtype: str = "float32", trust_remote_code: bool = False) -> nn.Module:
    """A value model from ``path`` (an HF dir or hub id; a causal LM checkpoint gets a new head)."""
    from transformers import AutoModelForTokenClassification

    try:
        model = AutoModelForTokenClassification.from_pretrained(
            path,
            num_labels=1,
            classifier_dropout=0.0,
            dtype=torch_dtype(dtype),
            trust_remote_code=trust_remote_code,
        )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"critic.path: cannot load {path!r}: {str(e).splitlines()[0]}") from None
    model.config.use_cache = False
    return own_memory(model)


def load_reward_model(path: str, *, dtype: str = "float32", trust_remote_code: bool = False) -> nn.Module:
    """A sequence-classification reward model with one output from ``path``."""
    from transformers import AutoModelForSequenceClassification

    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch_dtype(dtype), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"reward.model_path: cannot load {path!r}: {str(e).splitlines()[0]}") from None
    model.config.use_cache = False
    return own_memory(model)


def packed_sequence_scores(model: nn.Module, input_ids: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Reward-model score of each packed sequence, taken at its last token: ``(S,)``."""
    per_token = packed_scores(model, input_ids, cu_seqlens)  # (N,)
    return per_token[cu_seqlens[1:].long() - 1]
