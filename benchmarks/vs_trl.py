"""GRPO throughput: verl-flow's RL stages vs TRL's ``GRPOTrainer``, same model, prompts and settings.

    .venv/bin/pip install -c constraints.txt -e ".[bench]"      # trl 1.16 (the `bench` extra)
    .venv/bin/python benchmarks/vs_trl.py                        # 10 iterations × 2 repeats, ~1 min
    .venv/bin/python benchmarks/vs_trl.py --batch 32 --n 8 --mini 8 --repeats 3   # the quickstart's geometry
    .venv/bin/python benchmarks/vs_trl.py --iterations 5 --repeats 1 --beta 0   # quick, no KL
    .venv/bin/python benchmarks/vs_trl.py --device cuda --dtype bfloat16 --shape 0.5b   # on a GPU

Figures measured so far and their history: ``benchmarks/RESULTS.md``.

``--device`` cpu (default), cuda or auto (ours ``trainer.device``, TRL ``use_cpu``); ``--dtype bfloat16``:
bf16 mixed precision with fp32 master weights on both sides (ours ``{actor,ref}.mixed_precision``, our
generation staying in fp32; TRL ``bf16=True``); ``--shape quickstart`` (the config's ~0.3M-parameter
Qwen2) or ``0.5b`` (Qwen2.5-0.5B's geometry from scratch, 494M parameters: the run's tokenizer padded to
Qwen2.5's 151,936 ids, ``model.vocab_pad_to``, no download; CPU: ``--sft-steps 0`` and a tiny workload,
``--batch 4 --n 2 --mini 2 --max-new-tokens 32 --iterations 2 --repeats 1``: ~12.5 GiB peak RSS).
Printed too: the device, a plain matmul's FLOP/s in ``--dtype`` from the same run, achieved FLOP/s of
the training phases (FLOPs of :mod:`_hw`, on real tokens) and peak memory.

Set-up (not timed): ``configs/quickstart_grpo.yaml`` with its batch geometry overridden (default 8
prompts × 4 samples, 2 optimizer steps per iteration) on a temporary store; our stages build the data,
tokenizer and an SFT policy (``--sft-steps``), saved as an HF dir that every TRL run loads: both sides
start from the same weights (checked).

The same on both sides: the same prompts in the same order (token ids checked equal), ``rollout.n``
samples each (TRL ``num_generations``), the same max new tokens, temperature 1 and stop tokens; the
``synthetic/arithmetic`` rule reward; old log-probs recomputed, a low_var_kl (k3) KL loss to the frozen
start with ``--beta`` (0: no reference model), clip 0.2, token-mean loss, group-std advantages, AdamW
with the same settings and a constant lr; the same samples per optimizer step and number of steps; CPU
fp32 without gradient checkpointing, ``torch.set_num_threads(--threads)``, one process. Not the same:
the sampling RNG streams (so lengths differ after the first update; tokens/s accounts for it), TRL's
padded batches vs our buckets and packed micro-batches, our dual-clip (c=3). The TRL model gets
``use_cache=True`` back (our stages write ``use_cache: false``, without which TRL generates uncached).

Ours runs the RL loop's iteration body (the rollout → reward → ppo_update stage functions with their
Parquet artifacts, no Prefect task runs; ``benchmarks/orchestration.py`` measures Prefect's share) in a
plain loop; TRL is timed from the first ``on_step_begin`` to the last ``on_step_end``. A warm-up run of
each side comes first, then the sides alternate ``--repeats`` times. Prints samples/s and generated
tokens/s per run, each side's median and the ratio ours/TRL (goal ≥ 2×), and where the time goes: ours
from the stage manifests' summaries and the stage-call timers, TRL from timers wrapped around its
``_generate``, ``_calculate_rewards``, ``_get_per_token_logps_and_entropies``, ``compute_loss`` and
``training_step``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import warnings  # noqa: E402

from verl_core.runtime.env import set_quiet_env  # noqa: E402

set_quiet_env(offline=True)
warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' gradient_checkpointing rename

import torch  # noqa: E402
from _hw import (  # noqa: E402
    attention_width,
    device_name,
    forward_flops,
    matmul_flops,
    matmul_params,
    of_dense_peak,
    peak_memory_bytes,
    peak_memory_label,
    reset_peak_memory,
    resolve_device,
    train_flops,
)
from _setup import base_overrides, build_inputs  # noqa: E402

# Qwen2.5-0.5B's geometry (its config.json), built from scratch
SHAPES: dict[str, list[str]] = {
    "quickstart": [],
    "0.5b": [
        "model.hidden_size=896",
        "model.num_hidden_layers=24",
        "model.num_attention_heads=14",
        "model.num_key_value_heads=2",
        "model.intermediate_size=4864",
        "model.vocab_size=32000",
        # the trained tokenizer (a few hundred ids on this data) padded with unused ids to Qwen2.5's
        # 151,936 rows: the embedding and LM head (136M of the 494M parameters) at their real cost
        "model.vocab_pad_to=151936",
    ],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=10, help="RL iterations = TRL generation rounds per run")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each side (alternating)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared 2-core box)")
    p.add_argument(
        "--sft-steps", type=int, default=40, help="SFT warm-up steps before RL (0: scratch policy)"
    )
    p.add_argument("--beta", type=float, default=0.04, help="KL loss coefficient on both sides (0: no ref)")
    p.add_argument("--batch", type=int, default=8, help="prompts per iteration (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (rollout.n / num_generations)")
    p.add_argument(
        "--mini", type=int, default=4, help="prompts per optimizer step (actor.ppo_mini_batch_size)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="data.max_response_length")
    p.add_argument("--lr", type=float, default=None, help="actor learning rate (default: the config's)")
    p.add_argument("--train-size", type=int, default=2000, help="synthetic arithmetic training problems")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each side")
    p.add_argument(
        "--no-share-prompts",
        action="store_true",
        help="ours with model.share_prompts=false: every sample's prompt computed (as TRL does)",
    )
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu", help="both sides' device")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype of both sides"
    )
    p.add_argument("--shape", choices=tuple(SHAPES), default="quickstart", help="model geometry")
    return p.parse_args()


# --------------------------------------------------------------------------------------------------
# Set-up: model, tokenizer and prompts built by our own stages


def setup(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from stages.floor.artifacts import load_tokenizer, read_policy
    from stages.floor.policy import build_policy
    from verl_core.config import load_config

    overrides = [
        *base_overrides(root, args.iterations, args.sft_steps),
        f"data.arithmetic_train_size={args.train_size}",
        f"data.train_batch_size={args.batch}",
        f"data.max_response_length={args.max_new_tokens}",
        f"rollout.n={args.n}",
        "rollout.temperature=1.0",
        f"actor.ppo_mini_batch_size={args.mini}",
        "actor.ppo_epochs=1",
        *([f"actor.lr={args.lr}"] if args.lr is not None else []),
        "actor.lr_scheduler=constant",
        "actor.warmup_steps_ratio=0.0",
        "actor.loss_agg_mode=token-mean",
        f"actor.use_kl_loss={'true' if args.beta > 0 else 'false'}",
        f"actor.kl_loss_coef={args.beta}",
        "actor.kl_loss_type=low_var_kl",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        "algorithm.use_kl_in_reward=false",
        f"trainer.device={args.device}",
        *(["model.share_prompts=false"] if args.no_share_prompts else []),
        *SHAPES[args.shape],
        *(
            ["actor.mixed_precision.param_dtype=bfloat16", "ref.mixed_precision.param_dtype=bfloat16"]
            if args.dtype == "bfloat16"
            else []
        ),
    ]
    cfg = load_config(REPO / "configs" / "quickstart_grpo.yaml", overrides)
    t0 = time.perf_counter()
    ctx, tp, sft = build_inputs(cfg)
    store = ctx.store()
    tokenizer = load_tokenizer(store, tp)
    if sft:
        lm = read_policy(store, store.read_manifest(sft), "policy", cfg.model)
    else:
        lm = build_policy(cfg.model, tokenizer, seed=cfg.trainer.seed)
    hf_dir = root / "policy-hf"
    lm.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    prompts = store.read_table(store.read_manifest(tp), "prompt_tokens/train.parquet")
    n_params = sum(p.numel() for p in lm.parameters())
    n_layers, width = attention_width(lm.config)
    print(
        f"set-up: preprocess + template_pack{f' + sft ({args.sft_steps} steps)' if sft else ''} "
        f"{time.perf_counter() - t0:.1f} s; Qwen2 {n_params / 1e6:.3f}M params ({args.shape}: hidden "
        f"{lm.config.hidden_size}, {n_layers} layers), vocab {len(tokenizer)}, "
        f"{prompts.num_rows} training prompts"
    )
    return {
        "cfg": cfg,
        "tp": tp,
        "sft": sft,
        "tokenizer": tokenizer,
        "hf_dir": hf_dir,
        "prompts": prompts,
        "weights_sum": _weights_sum(lm),
        "store_url": ctx.store_url,
        "geometry": (matmul_params(lm), n_layers, width),  # N, n_layers, d of the FLOP formulas
        "device": resolve_device(args.device),
        "dtype": args.dtype,
    }


def _weights_sum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def _stop_ids(tokenizer: Any) -> list[int]:
    """What our HF engine stops on: eos and ``<|im_end|>``."""
    ids = [int(tokenizer.eos_token_id)]
    im_end = tokenizer.get_vocab().get("<|im_end|>")
    if im_end is not None and im_end not in ids:
        ids.append(int(im_end))
    return ids


def iteration_prompts(s: dict[str, Any], iterations: int) -> Any:
    """The rows our rollout stage uses in iterations 0..iterations-1, in order (a pyarrow table)."""
    from verl_core.data.prompt_stream import iteration_batch

    cfg = s["cfg"]
    rows: list[int] = []
    for it in range(iterations):
        rows += iteration_batch(
            s["prompts"].num_rows, cfg.data.train_batch_size, it, seed=cfg.data.seed, shuffle=cfg.data.shuffle
        ).rows
    return s["prompts"].take(rows)


# --------------------------------------------------------------------------------------------------
# Ours: the RL iteration body (flows.rl.run_iteration) without Prefect task runs, in a plain loop

UPDATE_PHASES = ("old_log_prob", "ref", "adv", "update_actor")  # the update summary's timing_s/*


def run_ours(s: dict[str, Any], iterations: int, run_id: str) -> dict[str, Any]:
    from flows.loop import Loop
    from flows.rl import loop_stages, run_iteration
    from flows.runs import start_run
    from stages.floor.opening import open_session
    from stages.floor.session import bound

    cfg = s["cfg"]
    ctx = start_run(cfg, run_id)
    store = ctx.store()
    t0 = time.perf_counter()
    state = open_session(ctx, cfg, s["tp"], s["sft"])
    init_s = time.perf_counter() - t0
    assert abs(_weights_sum(state.lm) - s["weights_sum"]) < 1e-6 * s["weights_sum"], "different start weights"
    torch.set_num_threads(_THREADS)

    stage_s: dict[str, float] = {}  # rollout, reward, update: each stage call as run_iteration times it
    times: dict[str, float] = defaultdict(float)  # the kernels, from the stages' manifest summaries
    samples = tokens = 0
    scores: list[float] = []
    flops: dict[str, float] = defaultdict(float)  # the training phases' model FLOPs (see _hw)
    geometry = s["geometry"]
    reset_peak_memory(s["device"])
    loop = Loop(ctx, cfg, s["tp"], state.lineage, state.iterations, stage_s, loop_stages(cfg, as_tasks=False))
    try:
        loop0 = time.perf_counter()
        for it in range(iterations):
            with bound(state):  # the stage functions find the session as the loop's task shells do
                done = run_iteration(loop, state, it)
            rs = store.read_manifest(done.rollout).summary
            ws = store.read_manifest(done.reward).summary
            us = state.pending[-1].summary  # the update's manifest is published by the next checkpoint
            samples += rs["samples"]
            tokens += rs["generated_tokens"]
            times["rollout: generate"] += rs["seconds"]
            times["reward: score_batch"] += ws["seconds"]
            for k in UPDATE_PHASES:
                times[f"update: {k}"] += us.get(f"timing_s/{k}", 0.0)
            scores.append(us["critic/score/mean"])
            table = store.read_table(store.read_manifest(done.rollout), "rollouts.parquet")
            lengths = [
                len(p) + len(r)
                for p, r in zip(
                    table.column("prompt_ids").to_pylist(),
                    table.column("response_ids").to_pylist(),
                    strict=True,
                )
            ]
            flops["old log-probs"] += forward_flops(geometry[0], lengths, *geometry[1:])
            if cfg.actor.use_kl_loss:
                flops["ref log-probs"] += forward_flops(geometry[0], lengths, *geometry[1:])
            flops["actor update"] += cfg.actor.ppo_epochs * train_flops(geometry[0], lengths, *geometry[1:])
        loop_s = time.perf_counter() - loop0
    finally:
        state.close()
    io = {
        "rollout: artifacts + other": stage_s["rollout"] - times["rollout: generate"],
        "reward: artifacts + other": stage_s["reward"] - times["reward: score_batch"],
        "update: artifacts + other": stage_s["update"] - sum(times[f"update: {k}"] for k in UPDATE_PHASES),
    }
    parts = {
        "generate": times["rollout: generate"],
        "reward (score_batch)": times["reward: score_batch"],
        "old log-probs": times["update: old_log_prob"],
        "ref log-probs": times["update: ref"],
        "advantages": times["update: adv"],
        "actor update (fwd+bwd+optim)": times["update: update_actor"],
        "artifacts I/O + stage bookkeeping": sum(io.values()),
    }
    parts["loop, not in the stages"] = loop_s - sum(parts.values())
    phase_s = {
        "old log-probs": times["update: old_log_prob"],
        "ref log-probs": times["update: ref"],
        "actor update": times["update: update_actor"],
    }
    return {
        "loop_s": loop_s,
        "init_s": init_s,
        "samples": samples,
        "tokens": tokens,
        "parts": parts,
        "detail": io,
        "score": scores,
        "phase_s": phase_s,
        "train_flops": dict(flops),
        "peak_bytes": peak_memory_bytes(s["device"]),
    }


# --------------------------------------------------------------------------------------------------
# TRL: GRPOTrainer on the same weights and prompts


def run_trl(s: dict[str, Any], iterations: int, out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from verl_core.reward.rules import RuleOptions, arithmetic_score

    cfg = s["cfg"]
    tokenizer = s["tokenizer"]
    table = iteration_prompts(s, iterations)
    texts = table.column("prompt_text").to_pylist()
    ids = table.column("input_ids").to_pylist()
    # TRL encodes plain-string prompts with processing_class(text=...): the ids must be ours
    enc = tokenizer(text=texts[: cfg.data.train_batch_size])["input_ids"]
    assert enc == ids[: cfg.data.train_batch_size], "TRL would tokenize the prompts differently"
    data = Dataset.from_dict({"prompt": texts, "ground_truth": table.column("ground_truth").to_pylist()})

    options = RuleOptions("strict", cfg.reward.score, cfg.reward.format_score)
    counts = {"samples": 0, "tokens": 0}
    rewards: list[float] = []

    def arithmetic_reward(completions: list[str], ground_truth: list[str], **kwargs: Any) -> list[float]:
        out = [arithmetic_score(c, g, options).score for c, g in zip(completions, ground_truth, strict=True)]
        counts["samples"] += len(completions)
        counts["tokens"] += sum(len(c) for c in kwargs["completion_ids"])
        rewards.append(sum(out) / len(out))
        return out

    # fp32 master weights on both sides; bf16=True below makes TRL compute in bf16 (accelerate autocast)
    model = AutoModelForCausalLM.from_pretrained(s["hf_dir"], dtype=torch.float32, attn_implementation="sdpa")
    assert abs(_weights_sum(model) - s["weights_sum"]) < 1e-6 * s["weights_sum"], "different start weights"
    # our scratch config says use_cache=False (packed training forwards need it); a pretrained model
    # says True, and TRL's padded generate needs the KV cache to be fair: turn it back on
    model.config.use_cache = True
    model.generation_config.use_cache = True
    model.generation_config.eos_token_id = _stop_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    a, d = cfg.actor, cfg.data
    steps_per_gen = d.train_batch_size // a.ppo_mini_batch_size
    targs = GRPOConfig(
        output_dir=str(out),
        use_cpu=s["device"].type == "cpu",
        bf16=s["dtype"] == "bfloat16",
        fp16=False,
        gradient_checkpointing=False,
        seed=cfg.trainer.seed,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        log_level="error",
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        shuffle_dataset=False,
        max_steps=iterations * steps_per_gen * a.ppo_epochs,
        per_device_train_batch_size=a.ppo_mini_batch_size * cfg.rollout.n,
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_gen,
        num_iterations=a.ppo_epochs,
        num_generations=cfg.rollout.n,
        max_completion_length=d.max_response_length,
        temperature=cfg.rollout.temperature,
        top_p=1.0,
        top_k=0,
        beta=a.kl_loss_coef if a.use_kl_loss else 0.0,
        epsilon=a.clip_ratio,
        loss_type="dapo",
        scale_rewards="group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=a.weight_decay,
        max_grad_norm=a.grad_clip,
        adam_beta1=0.9,
        adam_beta2=0.999,
        optim="adamw_torch",
        generation_kwargs={"use_cache": True},
        mask_truncated_completions=False,
        log_completions=False,
    )
    t0 = time.perf_counter()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=targs,
        train_dataset=data,
        processing_class=tokenizer,
    )
    build_s = time.perf_counter() - t0
    torch.set_num_threads(_THREADS)

    times: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)  # model FLOPs of the log-prob passes, on real tokens
    geometry = s["geometry"]

    def wrap(name: str, key: Callable[[], str] | None = None, count: bool = False) -> None:
        real = getattr(trainer, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            label = key() if key else name
            if count:  # (model, input_ids, attention_mask, ...): the mask's row sums are the real lengths
                mask = k["attention_mask"] if "attention_mask" in k else a[2]
                lengths = mask.sum(-1).tolist()
                grad = torch.is_grad_enabled()
                flops[label] += (train_flops if grad else forward_flops)(geometry[0], lengths, *geometry[1:])
            try:
                return real(*a, **k)
            finally:
                times[label] += time.perf_counter() - t

        setattr(trainer, name, timed)

    wrap("_generate")
    wrap("_calculate_rewards")
    wrap(
        "_get_per_token_logps_and_entropies",
        lambda: "logps no-grad" if not torch.is_grad_enabled() else "logps with grad",
        count=True,
    )
    wrap("_generate_and_score_completions")
    wrap("_prepare_inputs")
    wrap("compute_loss")
    wrap("training_step")

    marks: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            marks.setdefault("first", time.perf_counter())
            marks["begin"] = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            marks["last"] = time.perf_counter()
            times["steps"] += marks["last"] - marks["begin"]

    trainer.add_callback(Clock())
    trainer.remove_callback(PrinterCallback)  # the end-of-training metrics dict
    reset_peak_memory(s["device"])
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    loop_s = marks["last"] - marks["first"]
    gen_score = times["_generate_and_score_completions"]
    parts = {
        "generate": times["_generate"],
        "reward (reward function)": times["_calculate_rewards"],
        "old + ref log-probs (no grad)": times["logps no-grad"],
        "advantages + batch prep": gen_score
        - times["_generate"]
        - times["_calculate_rewards"]
        - times["logps no-grad"],
        "loss forward (compute_loss)": times["compute_loss"],
        "backward": times["training_step"] - times["_prepare_inputs"] - times["compute_loss"],
        "optimizer step + callbacks": times["steps"] - times["training_step"],
        "input buffering": times["_prepare_inputs"] - gen_score,
    }
    parts["loop, between steps"] = loop_s - times["steps"]
    phase_s = {
        "old + ref log-probs": times["logps no-grad"],
        "loss fwd + backward + optimizer": times["steps"] - times["_prepare_inputs"],
    }
    train_flop = {
        "old + ref log-probs": flops["logps no-grad"],
        "loss fwd + backward + optimizer": flops["logps with grad"],
    }
    return {
        "phase_s": phase_s,
        "train_flops": train_flop,
        "peak_bytes": peak_memory_bytes(s["device"]),
        "loop_s": loop_s,
        "init_s": build_s,
        "train_s": train_s,
        "samples": counts["samples"],
        "tokens": counts["tokens"],
        "parts": parts,
        "score": rewards,
    }


# --------------------------------------------------------------------------------------------------

_THREADS = 1


def main() -> None:
    global _THREADS
    args = parse_args()
    _THREADS = args.threads
    torch.set_num_threads(args.threads)
    import transformers
    import trl

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
        f"{device_name(device)}, {args.dtype}"
    )
    rate = matmul_flops(device, dtype)
    print(f"same-run matmul rate ({args.dtype}, 2048²): {rate / 1e12:.3f} TFLOP/s")
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        root = Path(tmp)
        s = setup(args, root)
        print(
            f"workload per iteration: {args.batch} prompts × {args.n} samples, ≤ {args.max_new_tokens} new "
            f"tokens, {args.batch // args.mini} optimizer steps of {args.mini * args.n} samples, "
            f"beta {args.beta}, lr {s['cfg'].actor.lr}; {args.iterations} iterations per run"
        )
        if not args.no_warmup:
            t = time.perf_counter()
            run_ours(s, 1, "warmup-ours")
            run_trl(s, 1, root / "trl-warmup")
            print(f"warm-up (1 iteration each, not counted): {time.perf_counter() - t:.1f} s")
        results: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
        for rep in range(args.repeats):
            for side in ("ours", "trl") if rep % 2 == 0 else ("trl", "ours"):
                if side == "ours":
                    r = run_ours(s, args.iterations, f"ours-{rep}")
                else:
                    r = run_trl(s, args.iterations, root / f"trl-{rep}")
                results[side].append(r)
                print(
                    f"  run {rep + 1} {side:>4}: {r['loop_s']:6.2f} s for {r['samples']} samples, "
                    f"{r['tokens']} tokens → {r['samples'] / r['loop_s']:6.1f} samples/s, "
                    f"{r['tokens'] / r['loop_s']:7.1f} tok/s (set-up not counted: {r['init_s']:.1f} s); "
                    f"mean reward first/last iteration {r['score'][0]:.3f}/{r['score'][-1]:.3f}"
                )
        report(results, args)
        report_training(results, args, rate, device)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    med = {}
    for side, runs in results.items():
        med[side] = {
            "samples/s": statistics.median(r["samples"] / r["loop_s"] for r in runs),
            "tok/s": statistics.median(r["tokens"] / r["loop_s"] for r in runs),
            "s/iter": statistics.median(r["loop_s"] / args.iterations for r in runs),
        }
    print("\nmedian of the runs:")
    for side, name in (("ours", "verl-flow"), ("trl", "TRL GRPOTrainer")):
        m = med[side]
        print(
            f"  {name:<16} {m['samples/s']:7.1f} samples/s  {m['tok/s']:8.1f} generated tok/s  "
            f"{m['s/iter']:.3f} s/iteration"
        )
    ratio = med["ours"]["samples/s"] / med["trl"]["samples/s"]
    tok_ratio = med["ours"]["tok/s"] / med["trl"]["tok/s"]
    print(
        f"  ratio ours/TRL: {ratio:.2f}× samples/s, {tok_ratio:.2f}× generated tok/s (goal ≥ 2×: "
        f"{'met' if ratio >= 2 else 'not met'})"
    )
    for side, name in (("ours", "verl-flow (run_iteration, no tasks)"), ("trl", "TRL GRPOTrainer")):
        runs = results[side]
        print(f"\nwhere the time goes, {name} (mean s/iteration over {len(runs)} run(s), % of the loop):")
        loop = statistics.mean(r["loop_s"] for r in runs)
        for key in runs[0]["parts"]:
            v = statistics.mean(r["parts"][key] for r in runs)
            print(f"  {key:<36} {v / args.iterations:7.3f} s  {100 * v / loop:5.1f}%")
        if side == "ours":
            for key in runs[0]["detail"]:
                v = statistics.mean(r["detail"][key] for r in runs)
                print(f"    of which {key:<30} {v / args.iterations:7.3f} s")


def report_training(
    results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, rate: float, device: torch.device
) -> None:
    """The training phases (this issue's part): old + reference log-probs and the actor update, their
    time, model FLOPs (:mod:`_hw`) and achieved FLOP/s against the same-run matmul rate."""
    print(
        "\ntraining phases (mean per iteration; model FLOPs of the full sequences' real tokens, see "
        "benchmarks/_hw.py: the work as defined, whoever skips part of it; ours computes each prompt group's "
        "prompt once (model.share_prompts), so its rate can exceed the matmul rate):"
    )
    secs = {}
    for side, name in (("ours", "verl-flow"), ("trl", "TRL")):
        runs = results[side]
        for phase in runs[0]["phase_s"]:
            t = statistics.mean(r["phase_s"][phase] for r in runs) / args.iterations
            f = statistics.mean(r["train_flops"][phase] for r in runs) / args.iterations
            print(
                f"  {name:<10} {phase:<32} {t:7.3f} s  {f / 1e12:8.4f} TFLOP  "
                f"{f / max(t, 1e-9) / 1e12:8.4f} TFLOP/s  {100 * f / max(t, 1e-9) / rate:5.1f}% of matmul"
            )
        total_t = statistics.mean(sum(r["phase_s"].values()) for r in runs) / args.iterations
        total_f = statistics.mean(sum(r["train_flops"].values()) for r in runs) / args.iterations
        secs[side] = total_t
        achieved = total_f / max(total_t, 1e-9)
        peak = max(r["peak_bytes"] for r in runs)
        print(
            f"  {name:<10} {'all training phases':<32} {total_t:7.3f} s  {total_f / 1e12:8.4f} TFLOP  "
            f"{achieved / 1e12:8.4f} TFLOP/s  {100 * achieved / rate:5.1f}% of matmul"
            f"{of_dense_peak(achieved, device)}"
        )
        print(f"  {name:<10} peak memory {peak / 2**30:.2f} GiB ({peak_memory_label(device)})")
    ratio = secs["trl"] / max(secs["ours"], 1e-9)
    print(f"  training phases, ours vs TRL: {ratio:.2f}× faster (TRL's seconds / ours)")


if __name__ == "__main__":
    main()
