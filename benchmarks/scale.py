"""One RL iteration at four model sizes: seconds, FLOP/s, memory and bytes of every phase, and the cost
model's prediction of the largest from the smaller ones (and a wide, shallow fifth fitted beside them).

    .venv/bin/python benchmarks/scale.py --sizes qs,34m,135m,w1k --hf     # ~20 min; waits for the lock
    .venv/bin/python benchmarks/scale.py --sizes 34m,135m,w1k --algos grpo --prompts 8 --tag p8   # ~10 min
    .venv/bin/python benchmarks/scale.py --sizes 0.5b --algos grpo --hf   # ~7 min, ~20 GiB resident
    .venv/bin/python benchmarks/scale.py --report     # tables + the fit on qs/34m/135m/w1k, checked on 0.5b

(``--tag``: a second workload shape under its own records, so that the fit can tell per-parameter
from per-FLOP costs apart; each iteration's record also splits the training steps (backward, clipping,
optimizer: seconds and the pages they first touch, ``ru_minflt``) and the weight sync (state dict,
heap trim, staging, the engine's reload), and each run measures the copy bandwidth beside the matmul
rate, and after the flow its model's matmul rates per shape and pass and the disk's fsync'd write
bandwidth (:mod:`verl_core.planning.rates`; ``--rates`` adds them to older records), and the checkpoint
save split (the policy's folder and store files, the trainer state's serialisation, the store's link +
fsync and sha256 reads). ``--micro 2 --tag mb2``: two samples per actor micro-batch, so several
micro-batches per optimizer step, which tells the update's per-micro-batch costs from its per-step ones.)

(0.5B PPO with a critic needs two 0.5B models with AdamW moments beside vLLM: more than 23 GiB.)

Sizes (``--sizes``), each built from scratch (``model.init=scratch``) with a tokenizer trained on the
run's text and padded to a real model's vocabulary (``model.vocab_pad_to``), tied embeddings:

==========  ==============================  ===========  =========================================
 name        hidden / layers / heads / kv /   vocabulary   geometry of
             MLP
==========  ==============================  ===========  =========================================
 qs          128 / 2 / 4 / 2 / 256            ≤ 512        the quickstart (its trained vocabulary)
 34m         512 / 6 / 8 / 2 / 1408           32,000       a Llama-2-vocabulary 34M model
 135m        576 / 30 / 9 / 3 / 1536          49,152       SmolLM-135M
 w1k         1024 / 4 / 16 / 4 / 5632         32,000       wide and shallow (112M), for the fit only
 0.5b        896 / 24 / 14 / 2 / 4864         151,936      Qwen2.5-0.5B
==========  ==============================  ===========  =========================================

The cost model is fitted on qs, 34m, 135m and w1k and checked on 0.5b (:data:`FIT_SIZES`). w1k is
there because 34m and 135m are nearly as wide (512, 576): across qs/34m/135m alone a cost per FLOP and
one per activation element or per layer grow together, and the fit cannot tell them apart.

Algorithms (``--algos``): ``grpo`` (GRPO, KL loss: a frozen reference) and ``ppo`` (GAE: a critic).
Workload (fixed across sizes): ``--prompts`` arithmetic prompts × ``--n`` samples, responses of at most
``--response`` tokens (a scratch model almost never samples the end token, so nearly every response
has the full length; the measured lengths are reported and used), two actor (and critic) mini-batches
(so old log-probs are recomputed for the second half of the batch), vLLM rollout (the pipeline's
engine, its own process); ``--iterations`` iterations, the last one reported (the first carries the
one-off warm-ups). Each (size, algorithm) runs in a fresh child process (peak RSS is per process and
cannot be reset), through the real Prefect flow (``flows.rl.rl_loop``: tasks, manifests, Parquet
artifacts, MLflow tracking), with ``--lock`` held around all the children of one invocation.

Per phase, the seconds the pipeline itself records (rollout ``seconds`` = ``engine.generate``, reward
``seconds``, the update's ``timing_s/*``), weight sync (``advance_policy``), the checkpoint save (the
checkpoint task's body) and load (the policy, trainer state and critic read back as a resume reads
them: from the store's own files, the state memory-mapped and each tensor read once),
Parquet writes (``StageWriter.write_table``); tokens/s; peak RSS of the trainer process and of the vLLM
process tree (sampled with psutil every 0.2 s); bytes the iteration added to the store; each phase's
FLOPs (:mod:`verl_core.planning.cost`) over its seconds against the matmul rate measured in the same
child (fp32, ``--threads``; before the run, before each iteration and after it: the report takes the
highest, the others caught a moment of the shared machine's load). Orchestration (issue 37 item 6):
the iteration's wall time (``flows.rl.run_iteration``) minus the kernels' seconds, split into Prefect
(task call − stage body) and artifacts + bookkeeping (stage body − kernel, of which Parquet writes).
``--hf``: the HF engine generates the same prompts once after the run (not a pipeline iteration).

JSON (``--out``, default ``/tmp/scale/scale.json``): one record per (size, algorithm), merged into an
existing file. Figures: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZES: dict[str, dict[str, Any]] = {
    "qs": {},  # the schema's scratch model, as configs/quickstart.yaml builds it
    "34m": {"hidden": 512, "layers": 6, "heads": 8, "kv": 2, "mlp": 1408, "vocab": 32000},
    "135m": {"hidden": 576, "layers": 30, "heads": 9, "kv": 3, "mlp": 1536, "vocab": 49152},
    # wide and shallow, for the fit only: 34m and 135m are nearly as wide (512, 576), so per-FLOP and
    # per-activation costs (which fall with the width, per FLOP) grow together across qs/34m/135m
    "w1k": {"hidden": 1024, "layers": 4, "heads": 16, "kv": 4, "mlp": 5632, "vocab": 32000},
    "0.5b": {"hidden": 896, "layers": 24, "heads": 14, "kv": 2, "mlp": 4864, "vocab": 151936},
}
ALGOS = {
    "grpo": ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true"],
    "ppo": ["algorithm.adv_estimator=gae"],
}
FIT_SIZES = ("qs", "34m", "135m", "w1k")  # the cost model is fitted on these, never on 0.5b
UPDATE_PHASES = ("old_log_prob", "ref", "values", "adv", "update_actor", "update_critic")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="qs,34m,135m,0.5b", help=f"comma list of {', '.join(SIZES)}")
    p.add_argument("--algos", default="grpo,ppo", help="comma list of grpo, ppo")
    p.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    p.add_argument("--n", type=int, default=2, help="samples per prompt")
    p.add_argument("--response", type=int, default=32, help="response tokens (maximum)")
    p.add_argument("--iterations", type=int, default=2, help="RL iterations (the last is reported)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    p.add_argument(
        "--micro", type=int, default=0,
        help="samples per actor micro-batch (0: the token budget, one micro-batch per mini-batch here; "
        "critic micro-batches are token budgets only); with --tag, several micro-batches per optimizer "
        "step for the fit",
    )  # fmt: skip
    p.add_argument("--hf", action="store_true", help="also time the HF engine's generation")
    p.add_argument(
        "--hold-gib", type=float, default=0.0,
        help="GiB another process fills and holds during each run (with --tag): less free memory, so "
        "that the checkpoint's page cache comes from reclaimed pages, as at 0.5B",
    )  # fmt: skip
    p.add_argument("--lock", default="/tmp/heavy.lock", help="lock held around all the children ('': none)")
    p.add_argument("--out", default="/tmp/scale/scale.json", help="JSON file the records merge into")
    p.add_argument("--workdir", default="/tmp/scale/runs", help="stores of the runs (deleted after)")
    p.add_argument(
        "--tag", default="", help="workload label: records keyed by (size, algorithm, tag); '': the table's"
    )
    p.add_argument("--report", action="store_true", help="print the table and the fit from --out only")
    p.add_argument(
        "--rates", action="store_true",
        help="measure the shape rates and write bandwidth of --out's records' sizes (one process, under "
        "--lock) into records that lack them, then report",
    )  # fmt: skip
    p.add_argument("--child", nargs=2, metavar=("SIZE", "ALGO"), help=argparse.SUPPRESS)
    return p.parse_args()


def overrides(size: str, algo: str, args: argparse.Namespace, root: Path) -> list[str]:
    """The run's config: the quickstart + the size + the algorithm + the fixed small workload."""
    s = SIZES[size]
    model = (
        [
            f"model.hidden_size={s['hidden']}", f"model.num_hidden_layers={s['layers']}",
            f"model.num_attention_heads={s['heads']}", f"model.num_key_value_heads={s['kv']}",
            f"model.intermediate_size={s['mlp']}", f"model.vocab_pad_to={s['vocab']}",
        ]
        if s
        else []
    )  # fmt: skip
    half = max(1, args.prompts // 2)
    micro = (
        ["actor.use_dynamic_bsz=false", f"actor.ppo_micro_batch_size_per_gpu={args.micro}"]
        if args.micro
        else []
    )  # fmt: skip
    return [
        f"store.url={root / 'store'}",
        "trainer.device=cpu",
        "trainer.resume_mode=disable",
        f"trainer.total_iterations={args.iterations}",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        f"trainer.save_freq={args.iterations}",
        "sft.enable=false",
        "data.arithmetic_train_size=200",
        "data.arithmetic_val_size=20",
        f"data.train_batch_size={args.prompts}",
        f"data.max_response_length={args.response}",
        f"rollout.n={args.n}",
        "rollout.name=vllm",
        f"actor.ppo_mini_batch_size={half}",
        f"critic.ppo_mini_batch_size={half}",
        *model,
        *micro,
        *ALGOS[algo],
    ]


# --------------------------------------------------------------------------------------------------
# The child: one (size, algorithm) through the real flow, instrumented


class Recorder:
    """What the wrappers below record, keyed by iteration."""

    def __init__(self) -> None:
        self.iteration = -1
        self.wall: dict[int, float] = {}
        self.body: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.parquet_s: dict[int, float] = defaultdict(float)
        self.parquet_bytes: dict[int, int] = defaultdict(int)
        self.sync_s: dict[int, float] = defaultdict(float)
        self.sleep_s: dict[int, float] = defaultdict(float)
        self.store_bytes: dict[int, int] = {}
        self.ckpt_save_s = 0.0
        self.ckpt_bytes = 0
        self.in_checkpoint = False
        self.rates: list[float] = []  # matmul rates measured before each iteration
        self.bandwidths: list[float] = []  # copy bandwidths measured before each iteration
        # per iteration, [seconds, fresh pages] of the training steps' parts (actor and critic summed)
        self.train: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
        self.sync_parts: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.ckpt_parts: dict[str, float] = defaultdict(float)  # the checkpoint's parts, summed
        self.ckpt_meminfo: dict[str, dict[str, int]] = {}  # /proc/meminfo before and after the save


def _wrap(owner: Any, name: str, after: Callable[[float, Any], None]) -> None:
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = fn(*a, **k)
        after(time.perf_counter() - t, out)
        return out

    setattr(owner, name, wrapper)


def _wrap_split(rec: Recorder, owner: Any, name: str, part: str, table: str = "train") -> None:
    """``owner.name`` timed into ``rec.train`` (seconds and minor page faults: pages first touched),
    ``rec.sync_parts`` (seconds) under ``part``, for the current iteration, or ``rec.ckpt_parts``
    (seconds, only while a checkpoint is saved)."""
    fn = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t, f = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return fn(*a, **k)
        finally:
            if table == "train":
                cell = rec.train[rec.iteration][part]
                cell[0] += time.perf_counter() - t
                cell[1] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f
            elif table == "ckpt":
                if rec.in_checkpoint:
                    rec.ckpt_parts[part] += time.perf_counter() - t
            else:
                rec.sync_parts[rec.iteration][part] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def _wrap_flag(task_obj: Any, rec: Recorder) -> None:
    """``rec.in_checkpoint`` set while ``task_obj.fn`` runs (its parts are timed only then)."""
    fn = task_obj.fn

    def flagged(*a: Any, **k: Any) -> Any:
        rec.in_checkpoint = True
        rec.ckpt_meminfo["before"] = meminfo()
        try:
            return fn(*a, **k)
        finally:
            rec.in_checkpoint = False
            rec.ckpt_meminfo["after"] = meminfo()

    task_obj.fn = flagged


def meminfo() -> dict[str, int]:
    """``MemFree``, ``Cached`` and ``MemAvailable`` of ``/proc/meminfo``, bytes: a checkpoint's page
    cache comes from free memory (first touched: slow on a VM whose freed pages go back to the host)
    or from reclaimed cache (:func:`verl_core.planning.cost.phase_features`, ``fresh_byte``)."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            if key in ("MemFree", "Cached", "MemAvailable"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def instrument(rec: Recorder, store_dir: Path) -> None:
    import torch

    import flows.rl as rl
    import stages.ppo_update as upd
    from stages.floor import checkpoint, session
    from verl_core.rollout import weight_sync
    from verl_core.rollout.vllm_process import VLLMProcessEngine
    from verl_core.store import store as store_module
    from verl_core.store.store import ArtifactStore, StageWriter
    from verl_core.training import adamw, engine

    # the training steps split (TrainEngine.step's parts), the weight sync split (trainer / engine)
    _wrap_split(rec, torch.Tensor, "backward", "backward")
    _wrap_split(rec, engine.SingleStrategy, "clip_grad_norm", "clip")
    _wrap_split(rec, adamw.GradScratchAdamW, "step", "optimizer")
    _wrap_split(rec, session, "policy_weights", "state_dict", "sync")
    _wrap_split(rec, session, "release_cached_memory", "heap_trim", "sync")
    _wrap_split(rec, weight_sync, "stage_weights", "stage", "sync")
    _wrap_split(rec, VLLMProcessEngine, "load_staged_weights", "engine_load", "sync")
    # the checkpoint split: the policy (save_pretrained's folder + its files into the store), the
    # trainer state's serialisation, and within both the store's part: link + fsync, sha256 reads
    _wrap_split(rec, checkpoint, "write_policy", "policy", "ckpt")
    _wrap_split(rec, checkpoint, "save_state", "state_serialise", "ckpt")
    _wrap_split(rec, ArtifactStore, "put_atomic", "store_put_fsync", "ckpt")
    _wrap_split(rec, store_module, "sha256_of", "sha256", "ckpt")

    def add_body(stage: str) -> Callable[[float, Any], None]:
        return lambda s, _: rec.body[rec.iteration].__setitem__(stage, rec.body[rec.iteration][stage] + s)

    for stage, task_obj in (("rollout", rl.rollout), ("reward", rl.reward), ("update", rl.ppo_update)):
        _wrap(task_obj, "fn", add_body(stage))

    def ckpt_done(s: float, _: Any) -> None:
        rec.ckpt_save_s += s
        rec.in_checkpoint = False

    _wrap(rl.checkpoint, "fn", ckpt_done)
    _wrap_flag(rl.checkpoint, rec)
    run_iteration = rl.run_iteration

    def timed_iteration(loop: Any, session: Any, it: int) -> Any:
        from verl_core.planning.cost import measure_cpu_copy_bandwidth, measure_cpu_matmul_rate

        rec.rates.append(measure_cpu_matmul_rate(seconds=0.5))  # before each iteration, not timed in it
        rec.bandwidths.append(measure_cpu_copy_bandwidth())
        rec.iteration = it
        t = time.perf_counter()
        out = run_iteration(loop, session, it)
        rec.wall[it] = time.perf_counter() - t
        rec.store_bytes[it] = _du(store_dir)
        return out

    rl.run_iteration = timed_iteration
    _wrap(upd, "advance_policy", lambda s, _: rec.sync_s.__setitem__(rec.iteration, s))
    _wrap(upd, "rest_engine", lambda s, _: rec.sleep_s.__setitem__(rec.iteration, s))

    def table_written(s: float, entry: Any) -> None:
        rec.parquet_s[rec.iteration] += s
        rec.parquet_bytes[rec.iteration] += entry.size

    _wrap(StageWriter, "write_table", table_written)


class RssSampler(threading.Thread):
    """Peak RSS of this process and of its descendants (the vLLM engine's tree apart), every 0.2 s."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import psutil

        self.me = psutil.Process()
        self.peak = {"trainer": 0, "vllm_tree": 0, "vllm_largest": 0, "other_children": 0}
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop.wait(0.2):
            vllm, largest, other = 0, 0, 0
            try:
                self.peak["trainer"] = max(self.peak["trainer"], self.me.memory_info().rss)
                children = self.me.children()
            except psutil.Error:
                continue
            for child in children:  # each child with its own descendants: the vLLM engine's tree apart
                try:
                    tree = [child, *child.children(recursive=True)]
                    rss = [p.memory_info().rss for p in tree]
                    is_vllm = any("vllm" in " ".join(p.cmdline()) for p in tree)
                except psutil.Error:
                    continue
                if is_vllm:
                    vllm += sum(rss)
                    largest = max(largest, *rss)
                else:
                    other += sum(rss)
            self.peak["vllm_tree"] = max(self.peak["vllm_tree"], vllm)
            self.peak["vllm_largest"] = max(self.peak["vllm_largest"], largest)
            self.peak["other_children"] = max(self.peak["other_children"], other)


def run_child(size: str, algo: str, args: argparse.Namespace) -> dict[str, Any]:
    from verl_core.runtime.env import set_quiet_env

    set_quiet_env(offline=True)
    import torch

    torch.set_num_threads(args.threads)
    from _setup import build_inputs
    from prefect import flow

    from flows.rl import rl_loop
    from flows.runs import start_run
    from stages.floor.locations import iteration_stage
    from verl_core.config import load_config
    from verl_core.planning.cost import measure_cpu_copy_bandwidth, measure_cpu_matmul_rate, workload_of
    from verl_core.planning.geometry import geometry_of
    from verl_core.planning.rates import measure_shape_rates, measure_write_bandwidth

    root = Path(args.workdir) / f"{size}-{algo}{args.tag}"
    subprocess.run(["rm", "-rf", str(root)], check=True)
    root.mkdir(parents=True)
    cfg = load_config(str(REPO / "configs" / "quickstart.yaml"), overrides(size, algo, args, root))
    t0 = time.perf_counter()
    _, tp, _ = build_inputs(cfg)
    setup_s = time.perf_counter() - t0
    rate_before = measure_cpu_matmul_rate()
    bandwidth_before = measure_cpu_copy_bandwidth()
    write_before = measure_write_bandwidth(str(root))
    rec = Recorder()
    store_dir = root / "store"
    instrument(rec, store_dir)
    sampler = RssSampler()
    sampler.start()

    @flow(name="scale-empty")
    def empty() -> None:
        return None

    t0 = time.perf_counter()
    empty()
    prefect_start = time.perf_counter() - t0
    ctx = start_run(cfg, "rl")
    before = _du(store_dir)
    t0 = time.perf_counter()
    out = rl_loop(ctx, cfg, tp, None)
    flow_s = time.perf_counter() - t0
    peak_flow = dict(sampler.peak)  # before this benchmark reads the checkpoint back
    rate_after = measure_cpu_matmul_rate()
    bandwidth_after = measure_cpu_copy_bandwidth()
    write_after = measure_write_bandwidth(str(root))
    # the model's own matmuls, after the flow: their operands (GBs at 0.5B, medium tensors kept in
    # glibc's heap) measured before it raised the flow's resident set by ~0.8 GiB
    shapes = measure_shape_rates(geometry_of(cfg.model))
    store = ctx.store()

    iterations = []
    for it in range(cfg.trainer.total_iterations):
        summary = {
            s: store.read_manifest(store.manifest_uri("rl", iteration_stage(it, s))).summary
            for s in ("rollout", "reward", "update")
        }
        rollouts = store.read_table(
            store.read_manifest(store.manifest_uri("rl", iteration_stage(it, "rollout"))),
            "rollouts.parquet",
        )
        iterations.append(_iteration_record(rec, it, summary, rollouts, before))
    load = _checkpoint_load(cfg, store, out.checkpoint, tp, args.hf, iterations[-1])
    sampler.stop.set()
    sampler.join()
    g = geometry_of(cfg.model)
    last = iterations[-1]
    w = workload_of(cfg, last["prompt_tokens"], last["response_tokens"])
    w = replace(w, max_new_tokens=last["max_response_tokens"])
    return {
        "size": size,
        "algo": algo,
        "geometry": asdict(g),
        "n_params": g.n_params,
        "matmul_params": g.matmul_params,
        "workload": {"prompts": args.prompts, "n": args.n, "response": args.response, "micro": args.micro},
        "workload_model": asdict(w),
        "threads": args.threads,
        "rate_flops": (rate_before + rate_after) / 2,
        "rate_before_after": [rate_before, rate_after],
        "rates_during": rec.rates,
        "bandwidths": [bandwidth_before, *rec.bandwidths, bandwidth_after],
        "shape_rates": shapes.to_json(),
        "write_bandwidths": [write_before, write_after],
        "tag": args.tag,
        "load_before": os.getloadavg(),
        "setup_s": setup_s,
        "prefect_start_s": prefect_start,
        "flow_s": flow_s,
        "iterations": iterations,
        "checkpoint_save_s": rec.ckpt_save_s,
        "checkpoint_split": dict(rec.ckpt_parts),
        "checkpoint_meminfo": rec.ckpt_meminfo,
        "hold_gib": args.hold_gib,
        **load,
        "peak_rss_flow": peak_flow,
        "peak_rss": {
            **sampler.peak,
            "trainer_ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        },
        "config_overrides": overrides(size, algo, args, root),
        "loadavg_end": os.getloadavg(),
        "commit": subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True
        ).stdout.strip(),
    }


def _iteration_record(
    rec: Recorder, it: int, summary: dict[str, dict[str, Any]], rollouts: Any, before: int
) -> dict[str, Any]:
    upd = summary["update"]
    phases = {
        "generation": summary["rollout"]["seconds"],
        "reward": summary["reward"]["seconds"],
        **{p: upd[f"timing_s/{p}"] for p in UPDATE_PHASES if f"timing_s/{p}" in upd},
        "weight_sync": rec.sync_s[it],
        "engine_sleep": rec.sleep_s[it],
    }
    page = os.sysconf("SC_PAGE_SIZE")
    kernel = sum(phases.values())
    body = dict(rec.body[it])
    wall = rec.wall[it]
    previous = rec.store_bytes.get(it - 1, before)
    prompt_len = rollouts.column("prompt_length").to_pylist()
    resp_len = rollouts.column("response_length").to_pylist()
    return {
        "iteration": it,
        "phases": phases,
        "train_split": {k: {"s": v[0], "fresh_bytes": v[1] * page} for k, v in rec.train[it].items()},
        "sync_split": dict(rec.sync_parts[it]),
        "parquet_s": rec.parquet_s[it],
        "parquet_bytes": rec.parquet_bytes[it],
        "store_bytes_added": rec.store_bytes[it] - previous,
        "wall_s": wall,
        "stage_body_s": body,
        "kernel_s": kernel,
        "orchestration_s": wall - kernel,
        "prefect_s": wall - sum(body.values()),
        "artifacts_s": sum(body.values()) - kernel,
        "samples": len(resp_len),
        "prompt_tokens": sum(prompt_len) / len(prompt_len),
        "response_tokens": sum(resp_len) / len(resp_len),
        "max_response_tokens": max(resp_len),
        "generated_tokens": summary["rollout"]["generated_tokens"],
        "group_prompts": _group_prompts(rollouts),
    }


def _group_prompts(rollouts: Any) -> list[list[int]]:
    seen: dict[int, list[int]] = {}
    for g, ids in zip(
        rollouts.column("group_id").to_pylist(), rollouts.column("prompt_ids").to_pylist(), strict=True
    ):
        seen.setdefault(g, ids)
    return list(seen.values())


def _tensors(obj: Any) -> Iterator[Any]:
    """Every tensor in a nested dict / list (a trainer state)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _checkpoint_load(
    cfg: Any, store: Any, ckpt_uri: str, tp_uri: str, hf: bool, last: dict[str, Any]
) -> dict[str, Any]:
    """Seconds to read the final checkpoint back as a resume does (``stages.floor.opening``): the
    policy model and the critic from the store's own files, the trainer state memory-mapped, each of
    its tensors read once (the pages the first optimizer step would read); with ``hf`` the HF engine's
    generation of the last iteration's prompts from the loaded policy."""
    from stages.floor.artifacts import load_tokenizer, local_model_dir, read_policy
    from stages.floor.engines import engine_kwargs
    from stages.floor.rollouts import sampling_params
    from verl_core.models.checkpoint import load_state
    from verl_core.models.heads import load_value_model
    from verl_core.rollout import make_engine

    manifest = store.read_manifest(ckpt_uri)
    t0 = time.perf_counter()
    lm = read_policy(store, manifest, "policy", cfg.model)
    with store.local_file(manifest, "trainer_state.pt") as path:
        state = load_state(path, "trainer_state.pt")
    for t in _tensors(state):
        t.sum()  # reads every page of the mapping
    if cfg.use_critic:
        with local_model_dir(store, manifest, "critic") as directory:
            load_value_model(str(directory), dtype=cfg.model.dtype)
    out: dict[str, Any] = {
        "checkpoint_load_s": time.perf_counter() - t0,
        "checkpoint_bytes": sum(entry.size for entry in manifest.files),
    }
    if hf:
        hf_cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"name": "hf"})})
        engine = make_engine("hf", lm, load_tokenizer(store, tp_uri), **engine_kwargs(hf_cfg))
        params = sampling_params(
            cfg.rollout, cfg.data.max_response_length, last["iteration"], validation=False
        )
        t0 = time.perf_counter()
        completions = engine.generate(last["group_prompts"], params)
        out["hf_generation_s"] = time.perf_counter() - t0
        out["hf_generated_tokens"] = sum(len(c.response_ids) for c in completions)
        engine.close()
    return out


# --------------------------------------------------------------------------------------------------
# The parent: children one at a time under the lock, records merged into --out; the report


def run_children(args: argparse.Namespace) -> None:
    """Each (size, algorithm) in a child process, one after the other, ``--lock`` held around them all
    (one wait for the machine, no other heavy run between the sizes compared)."""
    lock = open(args.lock, "a") if args.lock else None  # noqa: SIM115
    if lock is not None:
        print(f"waiting for {args.lock} ...", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        for size in args.sizes.split(","):
            for algo in args.algos.split(","):
                run_one(size, algo, args)
    finally:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()


def run_one(size: str, algo: str, args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    cmd = [sys.executable, __file__, "--child", size, algo, "--out", str(result), "--workdir", args.workdir]
    keys = ("prompts", "n", "response", "iterations", "threads", "tag", "micro", "hold_gib")
    cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    cmd += ["--hf"] if args.hf else []
    load = os.getloadavg()
    print(f"[{size} {algo} {args.tag}] start, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    t0 = time.perf_counter()
    from _hw import held_memory

    with held_memory(args.hold_gib):  # filled before the child starts, held until it ends
        code = subprocess.call(cmd)
    if code != 0:
        print(f"[{size} {algo}] FAILED (exit {code})", flush=True)
        return
    record = json.loads(result.read_text())
    record["child_s"] = time.perf_counter() - t0
    record["load_at_start"] = load
    records = json.loads(out.read_text()) if out.exists() else []
    key = (size, algo, args.tag)
    records = [r for r in records if (r["size"], r["algo"], r.get("tag", "")) != key] + [record]
    out.write_text(json.dumps(records, indent=1))
    print(f"[{size} {algo}] done in {record['child_s']:.0f} s → {out}", flush=True)
    subprocess.run(["rm", "-rf", str(Path(args.workdir) / f"{size}-{algo}{args.tag}")], check=False)


def add_rates(args: argparse.Namespace) -> None:
    """The shape rates (:func:`verl_core.planning.rates.measure_shape_rates`) and the write bandwidth
    of each size in ``--out`` that lacks them, measured now in this process under ``--lock``, written
    into those records with ``shape_rates_separate``: the time and load of this measurement (not the
    run's own)."""
    import torch

    from verl_core.planning.geometry import Geometry
    from verl_core.planning.rates import measure_shape_rates, measure_write_bandwidth

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    records = json.loads(out.read_text())
    lock = open(args.lock, "a") if args.lock else None  # noqa: SIM115
    if lock is not None:
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        load = os.getloadavg()
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        write = [measure_write_bandwidth(args.workdir) for _ in range(2)]
        done: dict[str, Any] = {}
        for r in records:
            if "shape_rates" in r:
                continue
            if r["size"] not in done:
                done[r["size"]] = measure_shape_rates(Geometry(**r["geometry"])).to_json()
                print(f"[{r['size']}] shape rates measured", flush=True)
            r["shape_rates"], r["write_bandwidths"] = done[r["size"]], write
            r["shape_rates_separate"] = {"when": time.strftime("%H:%M"), "load": load, "end": os.getloadavg()}
    finally:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
    out.write_text(json.dumps(records, indent=1))


def main() -> None:
    args = parse_args()
    if args.child:
        record = run_child(*args.child, args)
        Path(args.out).write_text(json.dumps(record))
        return
    if args.rates:
        add_rates(args)
    elif not args.report:
        run_children(args)
    from scale_report import report

    report(json.loads(Path(args.out).read_text()), FIT_SIZES)


if __name__ == "__main__":
    main()
