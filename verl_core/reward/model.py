"""Reward-model scoring: a one-label ``AutoModelForSequenceClassification`` on prompt + response text.

The text scored is the rollout's ``prompt_text`` (already chat-templated by the policy's template)
followed by its ``response_text``, tokenized by the reward model's own tokenizer without added
special tokens (the template carries them), and scored at the last token. Sequences are packed
without padding into micro-batches of at most ``max_tokens_per_batch`` tokens (a longer sequence
goes alone) and run through :func:`verl_core.models.heads.packed_sequence_scores`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from verl_core.errors import DataError
from verl_core.reward.scorers import RewardBatch, ScorerOutput

if TYPE_CHECKING:
    import torch


def load_reward_scorer(path: str, *, dtype: str, device: torch.device) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of the reward model at ``path`` (HF dir or hub id), eval mode on ``device``."""
    from transformers import AutoTokenizer

    from verl_core.models.heads import load_reward_model
    from verl_core.models.packed import use_varlen_attention

    model = load_reward_model(path, dtype=dtype).eval().to(device)
    use_varlen_attention(model)
    return model, AutoTokenizer.from_pretrained(path)


def reward_model_scores(
    model: Any, tokenizer: Any, texts: Sequence[str], *, max_tokens_per_batch: int
) -> list[float]:
    """The reward model's score of each text: ``(B,)`` floats, batched packed on the model's device."""
    import torch

    from verl_core.data.packing import dynamic_micro_batches, pack
    from verl_core.models.heads import packed_sequence_scores

    if not texts:
        return []
    ids: list[list[int]] = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    lengths = [len(x) for x in ids]
    if min(lengths) == 0:
        raise DataError(f"reward model: sample {lengths.index(0)} has no tokens to score")
    device = next(model.parameters()).device
    out = [0.0] * len(texts)
    with torch.no_grad():
        for part in dynamic_micro_batches(lengths, max(max_tokens_per_batch, max(lengths))):
            batch = pack([ids[i] for i in part], seq_index=part).to(device)
            scores = packed_sequence_scores(model, batch.input_ids, batch.cu_seqlens)  # (S,)
            for i, s in zip(part, scores.tolist(), strict=True):
                out[i] = float(s)
    return out


class ModelScorer(NamedTuple):
    """Reward-model scoring of ``prompt_text + response_text`` (see module docstring)."""

    model: Any
    tokenizer: Any
    max_tokens_per_batch: int

    def __call__(self, batch: RewardBatch) -> ScorerOutput:
        texts = [p + r for p, r in zip(batch.prompt_text, batch.response_text, strict=True)]
        scores = reward_model_scores(
            self.model, self.tokenizer, texts, max_tokens_per_batch=self.max_tokens_per_batch
        )
        return ScorerOutput(scores, [None] * len(scores))
