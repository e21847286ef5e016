"""The memory plan's formulas on tiny geometries, worked out by hand, and the fit check: a run that
cannot fit is refused in one line naming the knob; one that fits is not; the quickstarts fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_core.config import load_config
from verl_core.config.schema import VerlFlowConfig
from verl_core.planning.capacity import Capacity, fixes, refusal_line, shortfalls
from verl_core.planning.geometry import Geometry, geometry_of
from verl_core.planning.memory import (
    GIB,
    TRAINER_BASELINE,
    ProcessMemory,
    activation_bytes,
    activation_elements,
    no_grad_layer_bytes,
    plan_memory,
)

REPO = Path(__file__).resolve().parents[3]
# h 8, 2 layers, 2 query heads and 1 KV head of 4, MLP 16, 32 rows
TINY = Geometry("qwen2", 8, 2, 2, 1, 4, 16, 32)
# Qwen2.5-0.5B's geometry at its vocabulary, built from scratch (nothing is built here: a plan)
Q05 = [
    "model.hidden_size=896", "model.num_hidden_layers=24", "model.num_attention_heads=14",
    "model.num_key_value_heads=2", "model.intermediate_size=4864", "model.vocab_pad_to=151936",
    "actor.lr=1e-5",
]  # fmt: skip


def _cfg(*overrides: str, config: str = "quickstart.yaml") -> VerlFlowConfig:
    return load_config(REPO / "configs" / config, list(overrides))


def _component(cfg: VerlFlowConfig, name: str, phase: str = "actor update") -> int:
    trainer = next(p for p in plan_memory(cfg).processes if p.role == "trainer")
    return sum(c.nbytes for c in trainer.components(phase) if c.name == name)


def test_activation_formulas_by_hand() -> None:
    # A = 2 norms·3h + 3·H·d + 2·K·d + 4·I = 48 + 24 + 8 + 64 = 144 elements per token and layer
    assert activation_elements(TINY) == 144
    # fp32, 10 tokens: T·(L·A + 3h)·4 = 10·(288 + 24)·4 = 12,480 bytes (3h: the final norm)
    assert activation_bytes(TINY, 10, 4, checkpointed=False) == 12_480
    # checkpointed: each layer's input (L·h = 16), one layer recomputed (A = 144), the final norm (24)
    assert activation_bytes(TINY, 10, 4, checkpointed=True) == 10 * (16 + 144 + 24) * 4
    # bf16 compute: a layer's 48 norm elements stay fp32 (4 B), its other 96 take 2 B: 384 B; plus the
    # final norm's 24·4: 10·(2·384 + 96) = 8,640
    assert activation_bytes(TINY, 10, 2, checkpointed=False) == 8_640
    # a no-grad forward holds one layer's intermediates: T·(3I + 4h)·c = 10·(48 + 32)·4 = 3,200
    assert no_grad_layer_bytes(TINY, 10, 4) == 3_200


def test_model_state_is_weights_moments_and_gradients_at_the_master_dtype() -> None:
    cfg = _cfg()  # quickstart: fp32, one process, critic (GAE)
    n = geometry_of(cfg.model).n_params
    assert _component(cfg, "actor weights") == 4 * n
    assert _component(cfg, "actor AdamW moments") == 2 * 4 * n
    assert _component(cfg, "actor gradients") == 4 * n
    assert _component(cfg, "critic weights") > 0
    assert _component(cfg, "reference weights") == 0  # no KL term, no reference
    assert _component(cfg, "baseline (Python, torch, libraries)") == TRAINER_BASELINE


def test_reference_is_a_copy_except_under_lora() -> None:
    n = geometry_of(_cfg().model).n_params
    assert _component(_cfg("actor.use_kl_loss=true"), "reference weights") == 4 * n
    # LoRA: the reference is the policy with its adapters off, no copy; moments on the adapters only
    lora = _cfg("actor.use_kl_loss=true", "model.lora_rank=4")
    assert _component(lora, "reference weights") == 0
    adapters = geometry_of(lora.model).lora_params(4)
    assert _component(lora, "actor AdamW moments") == 2 * 4 * adapters


def test_gradient_checkpointing_and_a_smaller_budget_need_less() -> None:
    full = _component(_cfg(*Q05), "actor activations")
    assert _component(_cfg(*Q05, "model.gradient_checkpointing=true"), "actor activations") < full / 10
    # half the token budget, half the activations (4,096 → 2,048 tokens)
    assert _component(_cfg(*Q05, "actor.ppo_max_token_len_per_gpu=2048"), "actor activations") == full // 2


def test_vllm_engine_holds_weights_kv_cache_and_maps_the_staged_sync() -> None:
    cfg = _cfg("rollout.name=vllm", "rollout.cpu_kv_cache_gib=0.5")
    engine = next(p for p in plan_memory(cfg).processes if p.role == "vllm")
    names = {c.name: c.nbytes for c in engine.idle}
    assert names["vLLM KV cache"] == GIB // 2
    # during the sync it maps a staged bucket file too (its pages counted once in the machine's
    # total, as /dev/shm), and restores its layers' weights beside the packed ones: L·layer·c
    g = geometry_of(cfg.model)
    assert engine.peak_phase == "weight sync"
    restored = g.num_layers * g.layer_params * 4
    assert engine.at("weight sync", pooled=True) == engine.at("idle") + restored
    assert engine.at("weight sync") > engine.at("weight sync", pooled=True)


def test_sharding_divides_the_model_state_by_the_ranks() -> None:
    grpo = "quickstart_grpo.yaml"
    sharded = ("trainer.n_gpus_per_node=4", "actor.strategy=fsdp2", "rollout.share_weights=false")
    cfg = _cfg(*Q05, *sharded, config=grpo)
    one = _cfg(*Q05, config=grpo)
    assert _component(cfg, "actor AdamW moments") * 4 == _component(one, "actor AdamW moments")


def test_a_run_that_cannot_fit_is_refused_in_one_line_naming_the_knob() -> None:
    # 0.5B GRPO, fp32, no checkpointing: ~4 GB of activations at a 4,096-token budget on top of
    # weights, gradients and moments (~7.4 GB); against 12 GiB the knob that brings it under is named
    cfg = _cfg(*Q05, config="quickstart_grpo.yaml")
    plan, capacity = plan_memory(cfg), Capacity({"cpu": 12 * GIB}, {"cpu": "given"})
    (short,) = shortfalls(plan, capacity)
    assert short.refused and short.pool == "cpu"
    found = fixes(cfg, plan_memory, capacity, "cpu")
    assert found and all(need <= 12 * GIB for _, need in found)
    line = refusal_line(short, found, capacity.source)
    assert "\n" not in line and "over the 12.0 GiB" in line
    assert "model.gradient_checkpointing=true" in line


def test_05b_with_a_critic_on_a_4_gib_machine_has_no_knob() -> None:
    # the model state alone (two 0.5B models with weights and moments, ~11 GiB) exceeds 4 GiB
    cfg = _cfg(*Q05)  # quickstart: PPO with a critic
    capacity = Capacity({"cpu": 4 * GIB}, {"cpu": "given"})
    (short,) = shortfalls(plan_memory(cfg), capacity)
    assert short.refused
    line = refusal_line(short, fixes(cfg, plan_memory, capacity, "cpu"), capacity.source)
    assert line.startswith("memory: the run needs") and "no single knob" in line


def test_a_run_that_fits_is_allowed() -> None:
    cfg = _cfg(*Q05, "model.gradient_checkpointing=true", config="quickstart_grpo.yaml")
    assert shortfalls(plan_memory(cfg), Capacity({"cpu": 20 * GIB}, {"cpu": "given"})) == []


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("quickstart*.yaml")))
def test_quickstart_configs_fit_in_4_gib(name: str) -> None:
    plan = plan_memory(_cfg(config=name))
    assert shortfalls(plan, Capacity({"cpu": 4 * GIB}, {"cpu": "given"})) == []


def test_activation_formula_matches_the_tensors_a_packed_forward_saves() -> None:
    # every tensor autograd saves in a packed forward of a scratch Qwen2's decoder (parameters aside,
    # each storage once) against T·(L·A + 3h)·4: within 10% (the decoder alone saves 2h of the final
    # norm's 3h, the third being the LM head's input; RoPE's cos/sin and index tensors are extra)
    import torch

    from verl_core.models.loading import ScratchSpec, init_causal_lm, scratch_config
    from verl_core.models.packed import PackedCausalLM, packed_hidden_states
    from verl_core.planning.geometry import from_hf_config

    config = scratch_config(ScratchSpec("qwen2", 64, 2, 4, 2, 176, 256), 300, eos_token_id=0, pad_token_id=0)
    model = PackedCausalLM(init_causal_lm(config, seed=0).train())
    tokens = 128
    ids, cu = torch.randint(0, 300, (tokens,)), torch.arange(0, tokens + 1, 32, dtype=torch.int32)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        packed_hidden_states(model.lm, ids, cu)
    predicted = activation_bytes(from_hf_config(model.lm.config), tokens, 4, checkpointed=False)
    assert abs(sum(saved.values()) / predicted - 1) < 0.10


def test_on_a_gpu_vllm_takes_its_share_awake_and_the_checkpoint_lives_in_host_ram() -> None:
    cfg = _cfg("trainer.device=cuda", "rollout.name=vllm", "rollout.gpu_memory_utilization=0.4")
    plan = plan_memory(cfg, gpu_bytes=80 * GIB)
    by_name = {p.name: p for p in plan.processes}
    engine = by_name["vLLM engine (GPU)"]
    # awake (generation, reload): 0.4 × 80 GiB = 32 GiB; asleep during the updates: its CUDA context
    assert engine.at("generate") == int(0.4 * 80 * GIB)
    assert engine.at("actor update") < GIB
    # the checkpoint streams every file; one GPU's trainer state goes to its file one storage at a
    # time: no moments gathered to the host (a sharded engine's are, into rank 0's RAM)
    on_host = by_name["trainer, host RAM"]
    assert {c.name for c in on_host.components("checkpoint")} == {"baseline (Python, torch, libraries)"}
    sharded = _cfg(
        *(
            "trainer.device=cuda",
            "trainer.n_gpus_per_node=2",
            "actor.strategy=fsdp2",
            "critic.strategy=fsdp2",
        ),
        *("rollout.name=vllm",),
    )
    host = next(p for p in plan_memory(sharded).processes if p.name.endswith("host RAM"))
    assert "moments gathered to the host" in {c.name for c in host.components("checkpoint")}


# TINY's parameters by hand: embedding V·h = 32·8 = 256 (tied); a layer: q 8·8 + 8, k and v 8·4 + 4
# each, o 8·8, gate/up/down 3·8·16, two norms 2·8: 72 + 72 + 64 + 384 + 16 = 608; 2 layers + the
# final norm 8: P = 256 + 1,216 + 8 = 1,480. LoRA r=4 on the 7 linear maps, (in + out)·r each:
# q, o (16·4 = 64), k, v (12·4 = 48), gate, up, down (24·4 = 96): 512 a layer, P_a = 1,024.


def _trainer(*overrides: str) -> ProcessMemory:
    plan = plan_memory(_cfg(*overrides), TINY)
    return next(p for p in plan.processes if p.name == "trainer")


def _added(trainer: ProcessMemory, phase: str) -> dict[str, int]:
    """What ``phase`` holds beyond the resident state (the idle components)."""
    idle = {c.name for c in trainer.idle}
    return {c.name: c.nbytes for c in trainer.components(phase) if c.name not in idle}


def test_a_checkpoint_streams_its_files_and_holds_no_copy() -> None:
    # the quickstart (HF engine sharing the live module: no trim, the update's heap is kept): the
    # moments (2·P·4 = 11,840 bytes for the actor, the critic's too) and the policy's file (P·4 =
    # 5,920) stream to the store: nothing but the kept heap is added to the resident state
    assert set(_added(_trainer(), "checkpoint")) == {"heap kept from the update"}
    # all of the larger update's freed activations and logit chunks: the RL session retains the heap
    trainer = _trainer()
    freed = [
        sum(n for name, n in _added(trainer, phase).items() if "activations" in name or "chunks" in name)
        for phase in ("actor update", "critic update")
    ]
    assert _added(trainer, "checkpoint")["heap kept from the update"] == max(freed) > 0
    # vLLM: the sync trimmed the heap; nothing is added
    assert _added(_trainer("rollout.name=vllm"), "checkpoint") == {}


def test_a_scratch_lora_checkpoint_rebuilds_its_base_as_a_plain_module() -> None:
    # the frozen base rebuilt to be saved under its own names: P·4 = 5,920 while its files stream
    added = _added(_trainer("rollout.name=vllm", "model.lora_rank=4"), "checkpoint")
    assert added == {"plain base module": 5_920}


def test_the_sft_checkpoint_counts_no_copy_of_its_moments() -> None:
    # (the SFT policy and its moments are its own, not the RL state's idle ones)
    added = _added(_trainer("rollout.name=vllm", "sft.enable=true"), "sft checkpoint")
    assert set(added) == {"SFT policy weights", "SFT policy AdamW moments", "heap kept from the step"}


def test_adamw_step_temporaries_on_cpu_none_elsewhere_two_of_the_largest_parameter() -> None:
    # CPU, one process: GradScratchAdamW writes denom into the gradient, no temporary
    cpu = _trainer("rollout.name=vllm")
    assert not any("temporaries" in c.name for ph in cpu.phases for c in cpu.components(ph))
    # a GPU: torch's single-tensor AdamW, sqrt(v) and its quotient of the largest parameter, the
    # embedding's V·h = 256 > h·I = 128: 2·256·4 = 2,048 bytes
    gpu = _trainer("rollout.name=vllm", "trainer.device=cuda")
    step = {c.name: c.nbytes for c in gpu.components("actor update") if "temporaries" in c.name}
    assert step == {"actor optimizer step temporaries": 2_048}


def test_05b_ppo_with_a_critic_is_no_longer_refused_on_20_gib() -> None:
    # full fine-tuning PPO + critic at 0.5B (scale_0.5b_cpu, SFT off, no reference): its floor was
    # 24.5 GiB at the checkpoint when the moments (3.7 GiB per model) were counted serialised again;
    # streamed, the checkpoint adds nothing to the two models' weights (2·1.84 GiB) and moments
    # (2·3.68 GiB): the floor (its weight sync beside vLLM, 21.3 GiB) is within 20 GiB + 15%
    cfg = _cfg(
        *("algorithm.adv_estimator=gae", "actor.use_kl_loss=false", "sft.enable=false"),
        config="scale_0.5b_cpu.yaml",
    )
    capacity = Capacity({"cpu": 20 * GIB}, {"cpu": "given"})
    assert not any(s.refused for s in shortfalls(plan_memory(cfg, floor=True), capacity))
    trainer = next(p for p in plan_memory(cfg, floor=True).processes if p.role == "trainer")
    assert _added(trainer, "checkpoint") == {}


def test_a_tied_embedding_gets_a_second_gradient_at_the_end_of_backward() -> None:
    # the LM head's gradient of the tied (V, h) weight first, then the input lookup's, a fresh
    # V·h·4 = 32·8·4 = 1,024 bytes summed into it, beside every other gradient; the critic (no head,
    # one use of its embedding) and a LoRA actor (frozen embedding) have none
    update = _added(_trainer("rollout.name=vllm"), "actor update")
    assert update["actor tied embedding's input gradient"] == 1_024
    assert not any("tied" in n for n in _added(_trainer("rollout.name=vllm"), "critic update"))
    assert not any(
        "tied" in n for n in _added(_trainer("rollout.name=vllm", "model.lora_rank=4"), "actor update")
    )


def test_a_pool_sums_its_processes_at_a_phase_counting_copies_and_leaving_shared_pages_out() -> None:
    from verl_core.planning.parts import Component, MemoryPlan, ProcessMemory

    geometry = Geometry("qwen2", 16, 1, 2, 1, 8, 32, 100)
    trainer = ProcessMemory(
        "trainer", "trainer", "cpu", idle=(Component("weights", 100, "w"),),
        phases={"checkpoint": (Component("weights", 100, "w"), Component("file", 40, "f"))},
    )  # fmt: skip
    engine = ProcessMemory(
        "vllm", "vllm", "cpu", idle=(Component("kv", 30, "kv"), Component("staged", 500, "s", shared=True)),
        count=2,
    )  # fmt: skip
    gpu = ProcessMemory("gpu", "trainer", "cuda", idle=(Component("weights", 7, "w"),))
    plan = MemoryPlan((trainer, engine, gpu), geometry)
    # checkpoint: trainer 100 + 40, two engines at idle 2·30 (their 500 staged: shared) → 200
    assert plan.pool_at("cpu", "checkpoint") == 200
    assert plan.pool_at("cpu", "idle") == 100 + 2 * 30  # 160
    assert plan.pool_at("cuda", "checkpoint") == 7
    assert plan.pool_need("cpu") == (200, "checkpoint")
