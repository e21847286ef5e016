"""The rollout engine contract: every engine (HF generate, vLLM) implements :class:`RolloutEngine`.

Behaviour log-probs are those of each sampled token under the temperature-scaled distribution
``softmax(logits / T)`` *before* top-k/top-p truncation — the same quantity the trainer recomputes
with ``chunked_log_probs(..., temperature=T)``, so they can serve as old log-probs
(``actor.use_rollout_logprobs``). In greedy mode (T = 0) they are log-probs at T = 1.

Sampling is seeded per row: the sample ``j`` of a prompt with key ``k`` (``prompt_keys[i]``, default
its index ``i`` in the call) draws from ``derive_seed("sample", params.seed, k, j)`` alone, so the
same prompt keys give the same samples whether the prompts come in one call or split over several
calls or ranks (same weights). The stages key a prompt by its index in the iteration's batch.

Weight sync. An engine either shares the trainer's live module (``shares_weights``; the HF engine
by default) or holds its own weights (vLLM; HF with ``share_weights=False``), which must receive
every new policy before the next rollout: ``load_weights`` (the full state dict, gathered when the
trainer is sharded) or ``load_adapter`` (a LoRA adapter, the base staying loaded). Each call
carries the policy version it installs; ``policy_version`` is the version the engine holds, the one
every rollout row records. ``update_weights(model, version)`` does either from a live module in one
process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, runtime_checkable

from torch import Tensor, nn

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

    shares_weights: bool  # samples from the trainer's live module: nothing to copy on a sync

    @property
    def policy_version(self) -> int:
        """The policy version (PPO updates applied) of the weights the engine samples from."""
        ...

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        prompt_keys: Sequence[int] | None = None,
    ) -> list[Completion]:
        """``prompt_keys``: one distinct int per prompt seeding its samples (default: its index)."""
        ...

    def update_weights(self, model: nn.Module, version: int | None = None) -> None:
        """Make the engine sample from ``model``'s current weights (no disk round-trip), recorded as
        policy ``version`` (default: the held version + 1). One process: a sharded trainer gathers
        the weights and calls :meth:`load_weights` / :meth:`load_adapter` instead."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Install the full policy weights ``(name, tensor)`` as policy ``version``."""
        ...

    def load_adapter(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Install a LoRA adapter (PEFT's saved names) as policy ``version``; the base stays."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory while the trainer runs (no-op where nothing is held)."""
        ...

    def wake_up(self) -> None: ...

    def close(self) -> None:
        """Release what the engine holds beyond this process's memory (vLLM's engine process or
        subprocess, a server connection); idempotent. The RL state closes its engine when dropped."""
        ...
