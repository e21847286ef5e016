"""The rollout engine contract: every engine (HF generate, vLLM) implements :class:`RolloutEngine`.

Behaviour log-probs are those of each sampled token under the temperature-scaled distribution
``softmax(logits / T)`` *before* top-k/top-p truncation — the same quantity the trainer recomputes
with ``chunked_log_probs(..., temperature=T)``, so they can serve as old log-probs
(``actor.use_rollout_logprobs``). In greedy mode (T = 0) they are log-probs at T = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, runtime_checkable

from torch import nn

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 → off
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()  # stop strings: the response is cut after the first match
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's eos; the stop token is kept
    seed: int | None = None  # same seed, same prompts, same weights → same samples

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Completion(NamedTuple):
    prompt_index: int  # position of the prompt in the generate() input
    sample_index: int  # 0..n-1
    prompt_ids: list[int]
    response_ids: list[int]  # sampled tokens, the stop token included when finish_reason == "stop"
    response_text: str  # decoded response without special tokens
    logprobs: list[float]  # behaviour log-prob of each response token (see module docstring)
    finish_reason: FinishReason  # "stop": eos/stop token/stop string; "length": max_new_tokens hit


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates ``n`` completions per prompt. Prompts are strings (tokenized as-is, no template:
    template them first) or token-id lists. Results are ordered by (prompt_index, sample_index)."""

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[Completion]: ...

    def update_weights(self, model: nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (no disk round-trip)."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory while the trainer runs (no-op where nothing is held)."""
        ...

    def wake_up(self) -> None: ...
