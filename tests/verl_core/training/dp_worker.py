"""SFT steps and 3 RL updates (PPO with a critic and GAE; GRPO with a KL loss to a reference and
the rollout correction: truncated token weights and geometric rejection against behaviour log-probs),
replayed from one saved data file: in one process, or as one rank of a torchrun job.

    torchrun --standalone --nproc_per_node 2 tests/verl_core/training/dp_worker.py STRATEGY DATA.pt OUT.pt

Every rank reads the whole data file and passes the whole batch (SPMD); rank 0 alone writes OUT.pt:
per-step losses, per-iteration metrics and the final (full) weights of each run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tests.verl_core.training.specs import correction_spec, ppo_spec
from tests.verl_core.training.teardown import end_worker
from verl_core.algorithms import make_kl_controller
from verl_core.data.packing import pack
from verl_core.models.heads import value_model_from_policy
from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
from verl_core.models.packed import PackedCausalLM, PackedScoreModel
from verl_core.training.batch import RolloutBatch
from verl_core.training.data_parallel import MicroBatch, dp_view
from verl_core.training.engine import OptimSpec
from verl_core.training.ppo import PPOModels, PPOSpec, ppo_iteration
from verl_core.training.ppo_kernels import ActorLossSpec, response_log_probs
from verl_core.training.sft import sft_loss, sft_step_plan
from verl_core.training.strategies import build_train_engine, prepare_frozen

VOCAB = 61
GROUPS, SAMPLES = 4, 3  # 12 RL samples
SFT_ROWS, SFT_STEPS = 9, 3  # 3 rows per SFT step (split 2 | 1 over 2 ranks)
RL_ITERATIONS = 3
BUDGET = 14  # tokens per training micro-batch: uneven micro-batch counts across ranks (padding runs)
NO_GRAD_BUDGET = 15  # tokens per old/ref log-prob micro-batch: rank 0 pads one (see the test)
OPTIM = OptimSpec(
    lr=1e-2, weight_decay=0.01, warmup_steps=1, total_steps=12, scheduler="cosine", grad_clip=1.0
)


def make_data(path: Path) -> None:
    """The replayed artifacts: an SFT set and one RL batch (ragged prompts 2-6 tokens, responses 1-8,
    random 0/1 scores with both outcomes in every group), saved for every process to read."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    sft_lengths = torch.randint(4, 14, (SFT_ROWS,), generator=g).tolist()
    sft = [ids(n) for n in sft_lengths]
    masks = [[0] * (n // 2) + [1] * (n - n // 2) for n in sft_lengths]
    prompts = [ids(int(torch.randint(2, 7, (1,), generator=g))) for _ in range(GROUPS)]
    responses = [ids(int(torch.randint(1, 9, (1,), generator=g))) for _ in range(GROUPS * SAMPLES)]
    scores = [float((s + grp) % 2) for grp in range(GROUPS) for s in range(SAMPLES)]
    rl_prompts = [prompts[s // SAMPLES] for s in range(GROUPS * SAMPLES)]
    # behaviour log-probs: the start policy's, off by N(0, 0.3) per token (a rollout engine's mismatch)
    with torch.no_grad():
        n = len(responses)
        packed = RolloutBatch(rl_prompts, responses, torch.zeros(n), torch.zeros(n), torch.zeros(n))
        start = response_log_probs(PackedCausalLM(tiny_lm(0)), packed.micro(range(n)))[0]
    behaviour = start + 0.3 * torch.randn(start.shape, generator=g)
    torch.save(
        {
            "sft": sft,
            "sft_masks": masks,
            "prompt_ids": rl_prompts,
            "response_ids": responses,
            "group_ids": torch.arange(GROUPS).repeat_interleave(SAMPLES),
            "sample_index": torch.arange(SAMPLES).repeat(GROUPS),
            "scores": torch.tensor(scores),
            "behaviour_log_probs": behaviour,
        },
        path,
    )


def tiny_lm(seed: int) -> nn.Module:
    spec = ScratchSpec("qwen2", 32, 2, 4, 2, 64, 64)
    return init_causal_lm(scratch_config(spec, VOCAB, eos_token_id=0, pad_token_id=0), seed=seed)


class Recorder:
    """An engine that records each step's loss and the padding micro-batches this rank ran."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.padding = engine, 0
        self.losses: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def step(self, micro_batches: list[MicroBatch], loss_fn: Any, **kw: Any) -> Any:
        self.padding += sum(1 for mb in micro_batches if not mb.weight)
        stats = self.engine.step(micro_batches, loss_fn, **kw)
        self.losses.append(stats.loss)
        return stats


def engine_for(model: nn.Module, strategy: str) -> Recorder:
    return Recorder(build_train_engine(model, OPTIM, strategy=strategy, device="cpu"))


def full_weights(engine: Recorder, strategy: str) -> dict[str, Tensor]:
    """The unsharded weights (every rank must call this under FSDP2)."""
    if strategy == "fsdp2":
        from verl_core.training.distributed import full_model_state

        return full_model_state(engine.model)
    module = getattr(engine.model, "module", engine.model)  # DeepSpeed wraps the model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def run_sft(data: dict[str, Any], strategy: str) -> dict[str, Any]:
    engine = engine_for(PackedCausalLM(tiny_lm(0)), strategy)
    seqs, masks = data["sft"], data["sft_masks"]
    lengths = [len(s) for s in seqs]
    per_step = SFT_ROWS // SFT_STEPS
    for step in range(SFT_STEPS):
        rows = list(range(step * per_step, (step + 1) * per_step))
        plan = sft_step_plan(rows, lengths, masks, BUDGET, dp_view(engine))

        def loss(mb: MicroBatch, n: int = plan.num_loss_tokens) -> Tensor:
            p = pack([seqs[i] for i in mb.rows], loss_masks=[masks[i] for i in mb.rows])
            assert p.loss_mask is not None
            return (
                sft_loss(engine.model, p.input_ids, p.cu_seqlens, p.loss_mask, num_loss_tokens=n)[0]
                * mb.weight
            )

        engine.step(plan.micro_batches, loss, where="sft")
    return {"losses": engine.losses, "weights": full_weights(engine, strategy), "padding": engine.padding}


def rl_spec(estimator: str) -> PPOSpec:
    actor = ActorLossSpec(
        policy_loss="vanilla",
        loss_agg_mode="token-mean",
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=3.0,
        entropy_coeff=0.01,
        use_kl_loss=estimator == "grpo",
        kl_loss_coef=0.1,
        kl_loss_type="low_var_kl",
        temperature=1.0,
    )
    budgets = {"actor_token_budget": BUDGET, "critic_token_budget": BUDGET}
    budgets.update(log_prob_token_budget=NO_GRAD_BUDGET, ref_token_budget=NO_GRAD_BUDGET)
    return ppo_spec(
        actor,
        adv_estimator=estimator,
        lam=0.95,
        actor_mini_batch_groups=1,  # 3 rows per optimizer step: split 2 | 1 over 2 ranks
        critic_mini_batch_groups=1,
        horizon=8.0,
        rollout_correction=correction_spec(
            rollout_is="token", rollout_is_threshold=1.2, rollout_rs="geometric", rollout_rs_threshold=1.15
        )
        if estimator == "grpo"
        else correction_spec(),
        **budgets,
    )


def run_rl(data: dict[str, Any], strategy: str, estimator: str) -> dict[str, Any]:
    """3 iterations of ``estimator`` ("gae": PPO with a critic; "grpo": with a reference KL loss)."""
    lm = tiny_lm(0)
    critic = PackedScoreModel(value_model_from_policy(lm, seed=1)) if estimator == "gae" else None
    actor_engine = engine_for(PackedCausalLM(lm), strategy)
    critic_engine = None if critic is None else engine_for(critic, strategy)
    ref = None
    if estimator == "grpo":
        ref = prepare_frozen(PackedCausalLM(tiny_lm(5)), "fsdp2" if strategy == "fsdp2" else "single", "cpu")
    models = PPOModels(
        actor_engine.model,
        actor_engine,  # type: ignore[arg-type]
        ref,
        None if critic_engine is None else critic_engine.model,
        critic_engine,  # type: ignore[arg-type]
    )
    keys = ("prompt_ids", "response_ids", "group_ids", "sample_index", "scores", "behaviour_log_probs")
    batch = RolloutBatch(**{k: data[k] for k in keys})
    kl = make_kl_controller("fixed", kl_coef=0.0, target_kl=0.1, horizon=1)
    metrics = [
        ppo_iteration(models, batch, rl_spec(estimator), kl_ctrl=kl, seed=it).metrics for it in range(3)
    ]
    out = {
        "actor_losses": actor_engine.losses,
        "metrics": [
            {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))} for m in metrics
        ],
        "weights": full_weights(actor_engine, strategy),
        "padding": actor_engine.padding,
    }
    if critic_engine is not None:
        out["critic_losses"] = critic_engine.losses
        out["critic_weights"] = full_weights(critic_engine, strategy)
    return out


def run_all(data_path: Path, strategy: str) -> dict[str, Any]:
    data = torch.load(data_path, weights_only=False)
    return {
        "sft": run_sft(data, strategy),
        "ppo": run_rl(data, strategy, "gae"),
        "grpo": run_rl(data, strategy, "grpo"),
    }


def main() -> None:
    import torch.distributed as dist

    from verl_core.training.distributed import init_distributed

    strategy, data_path, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    rank, world = init_distributed("cpu")
    result = run_all(data_path, strategy)
    # the padding micro-batches of every rank (rank 0's own count alone would hide rank 1's)
    for run in result.values():
        t = torch.tensor([run["padding"]], dtype=torch.float64)
        dist.all_reduce(t)
        run["padding"] = int(t.item())
    if rank == 0:
        torch.save({"world_size": world, **result}, out)
    end_worker()  # exits: never a normal interpreter exit (teardown.py)


if __name__ == "__main__":
    main()
