"""Seconds of each phase of one RL iteration, predicted from the geometry, the workload and a matmul rate.

Every phase's time is a dot product of *features* (what the phase does, computed from the geometry and
the workload) with *coefficients* (what the machine charges per unit, a :class:`Calibration`)::

    seconds(phase) = Σ_k coefficient_k · feature_k(phase)

FLOPs (``N`` = :attr:`Geometry.matmul_params`, ``L`` layers, ``d`` = ``H·d_h``, ``S`` sequences of
``ℓ = P + R`` tokens, ``n`` samples per prompt):

* one causal forward: ``F = 2·(N − V·h)·T_b + 2·V·h·S·R + 2·L·d·S·ℓ²``: the decoder layers on the
  ``T_b`` stored tokens (``S·ℓ``, or ``(S/n)·P + S·R`` when a prompt's samples store it once), the LM
  head on the ``S·R`` response positions only (prompt logits are never computed), ``QKᵀ`` and ``AV``
  halved by the causal mask (Kaplan et al. 2020 §2.1);
* generation with a KV cache does the same matmuls (prefill once per prompt, one token per step);
* forward + backward = ``3·F`` (``4·F`` with gradient checkpointing: the forward is recomputed);
  LoRA: ``2·F`` (the frozen weights get no weight gradient; the adapters' FLOPs are ≪ ``F``);
* the critic's ``N_c = N − V·h``: a scalar value head instead of the LM head.

Memory traffic (``b`` bytes per weight, ``N_t`` trainable parameters, ``B`` the measured copy
bandwidth, bytes read + written per second, :func:`measure_cpu_copy_bandwidth`): a feature is bytes
over ``B``, so its coefficient counts passes over that memory at the plain copy's speed:

* ``weight_pass``: ``N·b / B`` per pass over the weights: 1 per forward phase, ``3·M`` per update of
  ``M`` micro-batches (forward read, backward read + gradient write; ``2·M`` under LoRA). At a few
  hundred tokens a micro-batch the matmuls of a 0.5B model are near memory-bound on CPU, and the
  tied ``V·h`` embedding's dense gradient is written whatever the batch;
* ``opt_param``: ``steps·N_t·b / B``: AdamW and clipping stream the weights, gradients and two moments
  several times per step (torch's single-tensor AdamW: ~80 bytes per fp32 parameter). With one
  micro-batch per step it is the same feature as the update's weight passes; ``benchmarks/scale.py
  --micro`` records several micro-batches per step, which tell them apart;
* ``sync_byte``: the staged bytes (every state-dict tensor, a tied head twice) over ``B``.

Checkpoint bytes are priced per byte (``save_byte``, ``load_byte``), each phase with its own fixed
cost (``save_call``; ``load_call``: a load builds the models), and the save's page cache by where it
comes from: ``fresh_byte`` per byte taken from free memory, ``min(C, free)`` of the checkpoint's
``C`` bytes. A file's pages are memory before they are disk; on a VM that hands freed pages back to
its host (virtio-balloon free page reporting, as on this project's CPU machines) the first touch of
free memory costs the host's fault: 2 GiB written into fresh pages took 4.8 s, into pages just freed
0.4 s. With free memory short (0.5B: trainer and engine hold most of it) the kernel reclaims cached
pages instead, already backed; unknown free memory (None): every byte fresh, an upper bound.

Workloads of one shape cannot tell per-parameter from per-FLOP costs apart (both grow with the size
alone), so the fit takes records of more than one shape (``benchmarks/scale.py --tag``: the same sizes
with twice the prompts: twice the tokens, the same parameters and steps).

A FLOP feature is ``F / rate`` (seconds at the measured matmul rate), so its coefficient is
``1 / efficiency``: 1.0 means the phase runs at the plain matmul's rate. Forwards and forward + backward
share one efficiency (the model FLOPs utilisation convention; the backward's extra cost over its FLOPs
shows in the per-parameter optimizer term and the phase's fixed cost); generation has its own (decode
at a small batch streams every weight per token: memory-bound on CPU). The other features are the
costs matmuls do not explain: ``T·V`` log-softmax elements per pass (memory-bound), per trainable
parameter per optimizer step (AdamW, clipping: memory traffic), per byte synced or checkpointed, per
sample scored, per stage call and per token stored (orchestration: Prefect task runs, manifests, Parquet,
tracking), and a fixed cost per phase (small kernels, Python, the engine's round trip).

Fixed costs per layer (kernel dispatch) and the activations' elementwise traffic are left out: across
sizes whose widths barely differ both grow with the FLOPs and a fit trades one for the other; with a
wide, shallow size among the fitted ones (``benchmarks/scale.py``'s w1k: 1024 wide, 4 layers) they
separate, and fitted they move no 0.5B phase by more than 0.03 (per layer) or make the old log-probs
worse (activations: 0.80-0.88 against 1.03-1.14).

The coefficients are fitted (:func:`fit_calibration`, non-negative least squares on relative error,
absolute below a floor of seconds) on measured phases of *smaller* models (``benchmarks/scale.py``),
then predict a larger one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

import torch

from verl_core.planning.geometry import Geometry
from verl_core.planning.nnls import nnls
from verl_core.planning.rates import (  # noqa: F401  (measurements re-exported for callers)
    ShapeRates,
    matmul_seconds,
    measure_cpu_copy_bandwidth,
    measure_cpu_matmul_rate,
)

if TYPE_CHECKING:
    from verl_core.config import VerlFlowConfig

PHASES = (
    "generation",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_actor",
    "update_critic",
    "weight_sync",
    "orchestration",
    "checkpoint_save",
    "checkpoint_load",
)
"""Per iteration, but the two checkpoint phases: per checkpoint (every ``trainer.save_freq``)."""

BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Calibration:
    """Seconds per unit of each feature (see the module docstring). ``*_flop``: 1 / efficiency."""

    gen_flop: float  # generation FLOPs / rate
    gen_call: float  # per generate call (engine round trip, scheduling)
    matmul_flop: float  # forwards (old / ref log-probs, values) and forward + backward: one efficiency
    fwd_call: float  # per no-grad forward phase (small kernels, Python)
    train_call: float  # per training phase
    logit: float  # per logit element (T·V) per pass
    weight_pass: float  # passes over the weights (N·b / bandwidth) per forward phase / micro-batch
    opt_param: float  # passes over the trainable weights (N_t·b / bandwidth) per optimizer step
    sync_byte: float  # weight sync: passes over the staged bytes (bytes / bandwidth)
    sync_call: float
    save_byte: float  # checkpoint, per byte written
    load_byte: float  # per byte read back
    save_call: float  # per checkpoint save
    fresh_byte: float  # per byte of the save's page cache taken from free memory (first touched)
    load_call: float  # per checkpoint load (building the models)
    reward_sample: float
    reward_call: float
    adv_token: float  # advantages and token rewards, per response token
    stage_call: float  # orchestration: per stage call (3 per iteration)
    artifact_token: float  # per token stored in the iteration's Parquet tables


# Fitted (fit_calibration) on this project's CPU machine (2 cores of an AMD EPYC VM, fp32, 2 torch
# threads, nothing else running), 29 Nov 2026 12:02-12:54 UTC, by benchmarks/scale.py on the quickstart's,
# 34M, 135M and a wide, shallow 112M geometry (1024 wide, 4 layers: across qs/34M/135M alone, 512 and
# 576 wide, a per-FLOP and a per-activation or per-layer cost grow together), GRPO and PPO, GRPO with
# twice the prompts (p8) and with two micro-batches per optimizer step (mb2), and 135M/w1k GRPO and PPO
# with 10 GiB held by another process (hold: free memory short at the checkpoint, so that its page cache
# comes from reclaimed pages and save_byte separates from fresh_byte): 18 records, at their best
# measured rate (196 GFLOP/s fp32) and copy bandwidth (50.0 GB/s), never on 0.5B. The defaults of a CPU
# plan. Checked on a 0.5B GRPO run (benchmarks/RESULTS.md): generation, old and reference log-probs,
# actor update, weight sync, checkpoint save and load and the iteration within ±25% (0.80-1.19);
# orchestration 0.132 s against 0.129-0.41 s over twelve 0.5B iterations, 0.77 of their median 0.171
# (one iteration, 0.23 s, in the table): the same work as at the small sizes, slowed in some iterations
# by contention for the 2 CPUs (the vLLM engine's idle loop, the trainer's other threads).
CPU_CALIBRATION = Calibration(
    gen_flop=4.03, gen_call=0.0913, matmul_flop=1.23, fwd_call=0.00978, train_call=0.0269, logit=3.11e-9,
    weight_pass=16.5, opt_param=0.0445, sync_byte=83.1, sync_call=0.538, save_byte=9.68e-10,
    load_byte=8.86e-10, save_call=0.0419, fresh_byte=1.75e-9, load_call=1.17, reward_sample=3.86e-6,
    reward_call=1.9e-4, adv_token=2.13e-6, stage_call=0.0359, artifact_token=4.7e-5,
)  # fmt: skip
CPU_RATE_FLOPS = 196e9  # the rate CPU_CALIBRATION was fitted at (measure_cpu_matmul_rate on that machine)
CPU_BANDWIDTH = 50.0e9  # bytes/s, measure_cpu_copy_bandwidth on that machine: the default bandwidth

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, FLOP/s, matched on the
# device name.
GPU_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}

# An ASSUMPTION, not measured: 40% of the dense peak for forwards and training (bf16, large batches),
# 10% for generation (decode at small batch is memory-bound), fixed costs of a few milliseconds, and
# store / sync bandwidths of a fast local disk (2 GB/s) and PCIe (10 GB/s); no cost for fresh pages (a
# GPU host's memory assumed backed, not handed back to a hypervisor).
GPU_CALIBRATION = Calibration(
    gen_flop=10.0, gen_call=0.05, matmul_flop=2.5, fwd_call=0.01, train_call=0.02,
    logit=1e-11, weight_pass=0.0, opt_param=0.1, sync_byte=0.1, sync_call=0.1, save_byte=5e-10,
    load_byte=5e-10, save_call=1.0, fresh_byte=0.0, load_call=1.0, reward_sample=1e-4, reward_call=0.01,
    adv_token=1e-7, stage_call=0.1, artifact_token=1e-6,
)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """One RL iteration's shape: ``samples`` = prompts × n sequences of ``prompt_tokens`` +
    ``response_tokens`` (means, or the config's maxima for a bound)."""

    samples: int
    prompt_tokens: float
    response_tokens: float
    old_log_prob_samples: int  # samples whose π_old is recomputed (not the first actor mini-batch's)
    actor_steps: int  # optimizer steps: epochs × mini-batches
    critic_steps: int  # 0: no critic
    micro_batches: int  # micro-batches of one pass over the whole batch (token budget)
    has_ref: bool
    lora_rank: int = 0
    gradient_checkpointing: bool = False
    dtype_bytes: int = 4
    max_new_tokens: int = 0  # decode steps (0: response_tokens)
    n: int = 1  # samples per prompt
    share_prompts: bool = False  # a prompt's samples store it once in the training forwards


def workload_of(
    cfg: VerlFlowConfig, prompt_tokens: float | None = None, response_tokens: float | None = None
) -> Workload:
    """The workload ``cfg`` runs per iteration; lengths default to ``data.max_prompt_length`` and
    ``data.max_response_length`` (an upper bound). Old log-probs skip the first actor mini-batch when
    its π_old is its own forward (no rollout log-probs, KL in reward or rollout correction), as
    :func:`verl_core.training.ppo.ppo_iteration` does."""
    d, a, c = cfg.data, cfg.actor, cfg.critic
    n = cfg.rollout.n
    samples = d.train_batch_size * n
    p = float(prompt_tokens if prompt_tokens is not None else d.max_prompt_length)
    r = float(response_tokens if response_tokens is not None else d.max_response_length)
    mini = -(-d.train_batch_size // a.ppo_mini_batch_size)
    rc = cfg.algorithm.rollout_correction
    corrected = rc.rollout_is is not None or rc.rollout_rs is not None
    own_forward = not (a.use_rollout_logprobs or cfg.algorithm.use_kl_in_reward or corrected)
    old = samples - min(samples, a.ppo_mini_batch_size * n) if own_forward else samples
    per_mini = a.ppo_mini_batch_size * n
    micro_per_mini = (
        math.ceil(per_mini * (p + r) / a.ppo_max_token_len_per_gpu)
        if a.use_dynamic_bsz
        else math.ceil(per_mini / a.ppo_micro_batch_size_per_gpu)
    )
    return Workload(
        samples=samples,
        prompt_tokens=p,
        response_tokens=r,
        old_log_prob_samples=old,
        actor_steps=a.ppo_epochs * mini,
        critic_steps=c.ppo_epochs * -(-d.train_batch_size // c.ppo_mini_batch_size) if cfg.use_critic else 0,
        micro_batches=max(1, mini * micro_per_mini),
        has_ref=cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward,
        lora_rank=cfg.model.lora_rank,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        dtype_bytes=BYTES[cfg.model.dtype],
        max_new_tokens=d.max_response_length,
        n=n,
        share_prompts=cfg.model.share_prompts,
    )


def forward_flops(
    g: Geometry, backbone_tokens: float, head_tokens: float, sequences: float, length: float
) -> float:
    """``2·(N − V·h)·T_b + 2·V·h·T_h + 2·L·d·S·ℓ²``: one causal forward whose decoder layers run on
    ``backbone_tokens`` and whose LM head on ``head_tokens`` (0: a critic's scalar head), over
    ``sequences`` of ``length`` tokens (the attention term)."""
    backbone = g.matmul_params - g.embedding_params
    attention = 2.0 * g.num_layers * g.attention_width * sequences * length**2
    return 2.0 * backbone * backbone_tokens + 2.0 * g.embedding_params * head_tokens + attention


def stored_tokens(w: Workload, samples: float) -> float:
    """Tokens the decoder layers run on for ``samples`` sequences: ``S·(P + R)``, or ``(S/n)·P + S·R``
    when the samples of one prompt store it once (``model.share_prompts``; vLLM's prefix cache the
    same in generation)."""
    if w.share_prompts:
        return samples / w.n * w.prompt_tokens + samples * w.response_tokens
    return samples * (w.prompt_tokens + w.response_tokens)


def train_factor(w: Workload) -> float:
    """Forward + backward in forwards: 3, 4 with gradient checkpointing (recompute), 2 under LoRA."""
    return (2.0 if w.lora_rank else 3.0) + (1.0 if w.gradient_checkpointing else 0.0)


def trainable_params(g: Geometry, w: Workload, *, critic: bool = False) -> int:
    """Parameters the optimizer updates: the adapters under LoRA, else all (a critic: no LM head rows,
    tied embeddings kept for the input)."""
    if critic:  # the backbone (an untied LM head dropped) plus a 1-output value head
        return g.n_params - (0 if g.tied_embeddings else g.embedding_params) + g.hidden_size + 1
    return g.lora_params(w.lora_rank) if w.lora_rank else g.n_params


def checkpoint_disk_bytes(g: Geometry, w: Workload) -> int:
    """Bytes a checkpoint writes to disk: :func:`checkpoint_bytes` plus the policy's file once more
    (``save_pretrained`` writes it into a temporary folder, then its bytes go to the store; the
    trainer state and a critic's files are linked into place)."""
    return checkpoint_bytes(g, w) + g.n_params * w.dtype_bytes


def checkpoint_bytes(g: Geometry, w: Workload) -> int:
    """Bytes a checkpoint holds: policy weights, AdamW's two moments of the trainable ones, and the
    critic's weights and moments (fp32 moments)."""
    policy = g.n_params * w.dtype_bytes + 8 * trainable_params(g, w)
    critic = (w.dtype_bytes + 8) * trainable_params(g, w, critic=True) if w.critic_steps else 0
    return policy + critic


def synced_bytes(g: Geometry, w: Workload) -> int:
    """Bytes a weight sync stages: the adapters under LoRA, else every state-dict tensor (a tied LM
    head under its own name too) at ``w.dtype_bytes``."""
    if w.lora_rank:
        return g.lora_params(w.lora_rank) * w.dtype_bytes
    return (g.n_params + (g.embedding_params if g.tied_embeddings else 0)) * w.dtype_bytes


def _matmul_s(
    g: Geometry,
    w: Workload,
    samples: float,
    head: bool,
    calls: int,
    passes: tuple[str, ...],
    shapes: ShapeRates,
) -> float:
    """Seconds of ``samples``' matmuls in ``calls`` equal micro-batches at the model's own shape rates
    (:mod:`verl_core.planning.rates`), ``passes`` of each; the attention's ``QKᵀ``/``AV`` at the
    shapes' best rate."""
    from verl_core.planning.memory_terms import chunk_tokens

    if samples <= 0:
        return 0.0
    ell = w.prompt_tokens + w.response_tokens
    t_b, t_h = stored_tokens(w, samples) / calls, samples * w.response_tokens / calls if head else 0.0
    layers = matmul_seconds(g, shapes, t_b, t_h, chunk_tokens(g.vocab_rows), passes)
    attention = forward_flops(g, 0.0, 0.0, samples, ell) * len(passes)
    return calls * layers + attention / max(max(r) for r in shapes.rates.values())


def phase_features(
    g: Geometry,
    w: Workload,
    rate_flops: float,
    bandwidth: float = CPU_BANDWIDTH,
    shapes: ShapeRates | None = None,
    write_bandwidth: float | None = None,
    free_bytes: float | None = None,
) -> dict[str, dict[str, float]]:
    """``{phase: {coefficient name: feature}}`` of one iteration (checkpoint phases: one checkpoint);
    FLOP features in seconds at ``rate_flops``, or, with ``shapes``, the forwards' and updates' at the
    model's own matmul rates (:mod:`verl_core.planning.rates`; generation stays at ``rate_flops``);
    memory ones at ``bandwidth`` (bytes/s); with ``write_bandwidth`` (bytes/s written and synced, a
    measured disk) the checkpoint save in seconds of its disk bytes at it, else per byte.
    ``free_bytes``: the host's free memory when the checkpoint is saved (None: unknown, every byte of
    its page cache fresh)."""
    ell = w.prompt_tokens + w.response_tokens
    tokens = w.samples * ell  # stored in the iteration's tables
    heads = w.samples * w.response_tokens  # the LM head runs on the response positions only
    v = g.vocab_rows
    f = {
        s: forward_flops(g, stored_tokens(w, s), s * w.response_tokens, s, ell) / rate_flops
        for s in {w.samples, w.old_log_prob_samples}
    }
    critic_f = forward_flops(g, stored_tokens(w, w.samples), 0.0, w.samples, ell) / rate_flops
    train = train_factor(w)
    fwd, actor_train, critic_train = dict(f), train * f[w.samples], 3.0 * critic_f
    if shapes is not None:
        grad: tuple[str, ...] = ("fwd", "dx") if w.lora_rank else ("fwd", "dx", "dw")
        grad += ("fwd",) if w.gradient_checkpointing else ()
        mb = w.micro_batches
        fwd = {s: _matmul_s(g, w, s, True, 1, ("fwd",), shapes) for s in f}
        critic_f = _matmul_s(g, w, w.samples, False, 1, ("fwd",), shapes)
        actor_train = _matmul_s(g, w, w.samples, True, mb, grad, shapes)
        critic_train = _matmul_s(g, w, w.samples, False, mb, ("fwd", "dx", "dw"), shapes)
    old_part = w.old_log_prob_samples / w.samples
    weights = g.n_params * w.dtype_bytes / bandwidth  # one pass over the weights
    critic_weights = trainable_params(g, w, critic=True) * w.dtype_bytes / bandwidth
    train_passes = (2.0 if w.lora_rank else 3.0) * w.micro_batches
    ckpt = float(checkpoint_bytes(g, w))
    out: dict[str, dict[str, float]] = {
        "generation": {"gen_flop": f[w.samples], "gen_call": 1.0},
        "reward": {"reward_sample": w.samples, "reward_call": 1.0},
        "old_log_prob": {
            "matmul_flop": fwd[w.old_log_prob_samples],
            "logit": old_part * heads * v,
            "weight_pass": weights if old_part else 0.0,
            "fwd_call": 1.0 if old_part else 0.0,
        },
        "ref": {"matmul_flop": fwd[w.samples], "logit": heads * v, "weight_pass": weights, "fwd_call": 1.0},
        "values": {"matmul_flop": critic_f, "weight_pass": critic_weights, "fwd_call": 1.0},
        "adv": {"adv_token": w.samples * w.response_tokens},
        "update_actor": {
            "matmul_flop": actor_train,
            "logit": 3.0 * heads * v,
            "weight_pass": train_passes * weights,
            "opt_param": w.actor_steps * trainable_params(g, w) * w.dtype_bytes / bandwidth,
            "train_call": 1.0,
        },
        "update_critic": {
            "matmul_flop": critic_train,
            "weight_pass": 3.0 * w.micro_batches * critic_weights,
            "opt_param": w.critic_steps * critic_weights,
            "train_call": 1.0,
        },
        "weight_sync": {"sync_byte": synced_bytes(g, w) / bandwidth, "sync_call": 1.0},
        "orchestration": {"stage_call": 3.0, "artifact_token": tokens},
        "checkpoint_save": {
            "save_byte": ckpt if write_bandwidth is None else checkpoint_disk_bytes(g, w) / write_bandwidth,
            "fresh_byte": ckpt if free_bytes is None else min(ckpt, max(free_bytes, 0.0)),
            "save_call": 1.0,
        },
        "checkpoint_load": {"load_byte": ckpt, "load_call": 1.0},
    }
    if not w.has_ref:
        out.pop("ref")
    if not w.critic_steps:
        out.pop("values")
        out.pop("update_critic")
    return out


def predict(features: dict[str, dict[str, float]], calibration: Calibration) -> dict[str, float]:
    """``{phase: Σ_k coefficient_k · feature_k}``."""
    c = asdict(calibration)
    return {phase: sum(c[k] * x for k, x in feats.items()) for phase, feats in features.items()}


def predict_seconds(
    cfg: VerlFlowConfig,
    geometry: Geometry,
    rate_flops: float,
    calibration: Calibration,
    workload: Workload | None = None,
    bandwidth: float = CPU_BANDWIDTH,
    shapes: ShapeRates | None = None,
    write_bandwidth: float | None = None,
    free_bytes: float | None = None,
) -> dict[str, float]:
    """Seconds per phase of one iteration of ``cfg`` (the checkpoint phases: per checkpoint), plus
    ``iteration``: the per-iteration phases summed and one save per ``trainer.save_freq`` iterations.
    ``workload`` None: :func:`workload_of` ``cfg`` at its maximum lengths. ``shapes`` /
    ``write_bandwidth``: measured (:mod:`verl_core.planning.rates`), with a calibration fitted on
    features priced the same way (``benchmarks/scale_report.py``); ``free_bytes``: the host's free
    memory at the checkpoint (:func:`phase_features`)."""
    w = workload or workload_of(cfg)
    features = phase_features(geometry, w, rate_flops, bandwidth, shapes, write_bandwidth, free_bytes)
    out = predict(features, calibration)
    per_iteration = sum(s for p, s in out.items() if not p.startswith("checkpoint"))
    every = cfg.trainer.save_freq or cfg.trainer.total_iterations
    out["iteration"] = per_iteration + out["checkpoint_save"] / max(every, 1)
    return out


def fit_calibration(rows: list[tuple[dict[str, float], float]], floor_s: float = 0.0) -> Calibration:
    """Non-negative coefficients minimising Σ ((prediction − seconds) / max(seconds, floor_s))² over
    ``rows`` of ``(features of one phase, measured seconds)``: relative error, so a 0.5 s phase of a
    small model weighs as much as a 10 s one; below ``floor_s`` absolute error (scaled by it), so that
    phases of a few milliseconds, timed to a few milliseconds on a shared machine, do not pull the
    fit like exact ones. Coefficients no row uses are 0."""
    names = [f.name for f in fields(Calibration)]
    kept = [(x, y) for x, y in rows if y > 0]
    a = torch.tensor([[x.get(k, 0.0) / max(y, floor_s) for k in names] for x, y in kept], dtype=torch.float64)
    coef = nnls(a, torch.tensor([y / max(y, floor_s) for _, y in kept], dtype=torch.float64))
    return Calibration(**{k: float(v) for k, v in zip(names, coef.tolist(), strict=True)})


def gpu_peak_flops(device_name: str) -> float | None:
    """The data-sheet dense bf16 peak of a GPU named ``device_name`` (FLOP/s), None off the table."""
    return next((peak for key, peak in GPU_PEAK_FLOPS.items() if key in device_name), None)
