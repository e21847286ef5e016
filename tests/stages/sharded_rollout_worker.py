"""Run by test_sharded_rollouts.py: the rollouts of 7 prompts × 3 samples, sharded over the ranks of
``torchrun`` (or in one process when run without it): one engine per rank, then one engine of
2 ranks on rank 0 (rank 1 holds none); each rank writes every token id it got to OUT.RANK."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from stages.floor.rollouts import sharded_rollouts
from tests.verl_core.rollout.conftest import arithmetic_texts, tiny_model
from tests.verl_core.training.teardown import end_worker
from verl_core.config import MultiTurnConfig
from verl_core.data.tokenizer import train_tokenizer
from verl_core.rollout import HFEngine, RolloutEngine, SamplingParams
from verl_core.rollout.placement import GroupMemberEngine
from verl_core.rollout.requests import encode_prompts

PROMPTS = [
    "Q: 12 + 7 = ? A:",
    "Q: 3 + 4",
    "Q: 45 + 45 = ? A: 90 Q: 1 + 2 = ? A:",
    "Q:",
    "Q: 9",
    "Q: 1 +",
    "A: 5",
]


class TensorParallelHF(HFEngine):
    """An HF engine standing for an engine of 2 ranks (vLLM, tensor_parallel_size 2)."""

    tensor_parallel_size = 2


def rollouts(group: bool = False) -> list[list[object]]:
    """One engine per rank; ``group``: one engine for both ranks, on rank 0 (rank 1 holds a
    GroupMemberEngine and receives everything through the group)."""
    tok = train_tokenizer(arithmetic_texts(400), 300)
    engine: RolloutEngine
    if not group:
        engine = HFEngine(tiny_model(tok), tok, max_batch_size=4)
    elif dist.get_rank() == 0:
        engine = TensorParallelHF(tiny_model(tok), tok, max_batch_size=4)
    else:
        engine = GroupMemberEngine(tensor_parallel_size=2)  # generate() would raise
    ids = encode_prompts(tok, PROMPTS)
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7)
    out = sharded_rollouts(engine, tok, ids, sampling, MultiTurnConfig(), 12)
    return [[c.prompt_index, c.sample_index, c.response_ids, c.logprobs] for c in out.completions]


def main(path: str) -> None:
    dist.init_process_group("gloo")
    result = {"per_rank": rollouts(), "group": rollouts(group=True)}
    with open(f"{path}.{dist.get_rank()}", "w") as f:
        json.dump(result, f)
    end_worker()


if __name__ == "__main__":
    main(sys.argv[1])
