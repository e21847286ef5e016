"""The weight sync from an FSDP2-sharded policy, one rank of ``torchrun --nproc_per_node 2``:
every rank takes part in gathering the full weights
(:func:`verl_core.training.distributed.policy_weights`), rank 0 alone keeps them (on the CPU), loads
them into its own-copy HF engine and samples greedily; writes ``OUT_DIR/rank{r}.json``.

torchrun --nproc_per_node 2 tests/stages/weight_sync_worker.py OUT_DIR
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tests.verl_core.training.teardown import end_worker
from verl_core.data.tokenizer import train_tokenizer
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.rollout import HFEngine, SamplingParams
from verl_core.training.distributed import policy_weights

PROMPTS = ["Q: 12 + 7 = ? A:", "Q: 3 + 4", "Q: 45 + 45 = ? A:"]


def tiny(tok: object, seed: int) -> torch.nn.Module:
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 128)
    config = scratch_config(spec, len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # type: ignore[arg-type,attr-defined]
    return init_causal_lm(config, seed=seed)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tok = train_tokenizer([f"Q: {a} + {b} = ? A: {a + b}" for a in range(20) for b in range(20)], 300)
    policy = tiny(tok, seed=1)  # the trainer's policy, then sharded
    reference = copy.deepcopy(policy).eval()
    for layer in policy.model.layers:  # type: ignore[union-attr]
        fully_shard(layer)
    fully_shard(policy)
    engine = HFEngine(tiny(tok, seed=2), tok, share_weights=False)  # stale: another model
    # every rank all-gathers; rank 0 alone keeps the weights (it owns the engine), on the CPU
    weights = policy_weights(policy, keep=rank == 0)
    if rank == 1:
        (out / "rank1.json").write_text(json.dumps({"kept": len(weights)}))
        end_worker()  # waits for rank 0; fully_shard's state keeps the group past its destruction
    expected = reference.state_dict()
    max_diff = max((weights[k].float() - v.float()).abs().max().item() for k, v in expected.items())
    engine.load_weights(weights.items(), 1)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    got = [c.response_ids for c in engine.generate(PROMPTS, greedy)]
    want = [c.response_ids for c in HFEngine(reference, tok).generate(PROMPTS, greedy)]
    result = {
        "keys_equal": sorted(weights) == sorted(expected),
        "max_diff": max_diff,
        "tokens_equal": got == want,
        "version": engine.policy_version,
        "devices": sorted({str(w.device) for w in weights.values()}),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    end_worker()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
