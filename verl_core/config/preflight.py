"""Cross-field checks of a whole config, run when it is loaded, before any work.

Each check returns one line that names the field(s), the value given and what was expected, so a run
that cannot work (or would silently not do what it says) is refused at ``verl-flow run`` with every
problem listed, instead of failing an hour in or shipping an under-trained model.

What is checked:

* one arithmetic teacher: the tool-using one does not mix with the terse or incomplete ones;
* batch sizes: mini-batches divide the prompts of an iteration (whole prompt groups per optimizer step);
  group-relative estimators get more than one sample per prompt; the data can fill one batch;
* token budgets: every micro-batch budget holds one full-length sample (prompt + response), so a budget
  set for memory is a bound, not a hint; the longest sequence fits the model's positions;
* schedule: the actor is updated at least once (``trainer.critic_warmup``);
* dynamic sampling (``algorithm.filter_groups``) only with a group-relative estimator;
* fork/replay (``parent``): the start leaves iterations to train; no replay of dynamic sampling;
* placement: in deployments mode every location is reachable from every worker;
* distribution: several ranks train with sharded engines (fsdp2/deepspeed), their prompts can be shared,
  several nodes have a rendezvous, tensor parallelism divides the node and the heads;
* precision: mixed precision never computes above the master weights' dtype; an AdamW step is not
  below the rounding of the weights it updates (:func:`_update_below_rounding`); liger only on CUDA.

:func:`advice` holds the lines of configs that run but probably do not do what their author wants; the
loader logs them as warnings (a config may do it on purpose):

* a model trained from scratch with a pretrained model's actor learning rate (the schema default);
* a key set to a value that does nothing under another key's value (:mod:`.inert`).

Micro-batch sizes need not divide mini-batches: loss denominators are summed over the whole mini-batch
(:mod:`verl_core.training.ppo`), so an uneven last micro-batch weighs its tokens exactly like the others.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from verl_core.config.inert import inert_settings

if TYPE_CHECKING:
    from verl_core.config.schema import VerlFlowConfig

# Estimators whose baseline is the other samples of the same prompt (a group of one has none).
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


# Below this, an actor learning rate is a pretrained model's: verl's 1e-6 (the schema default, for a
# pretrained ~0.5B model) or a fine-tune's few 1e-6. The CPU quickstarts' from-scratch models (~0.3M
# parameters) learn under RL at 6e-5 (1e-4 with tools); at 1e-6 they barely move (issue 19).
SCRATCH_MIN_ACTOR_LR = 1e-5
QUICKSTART_ACTOR_LR = 6e-5


def problems(cfg: VerlFlowConfig) -> list[str]:
    """Every cross-field problem of ``cfg``, one line each (empty: the config can run)."""
    found: list[str] = []
    for check in CHECKS:
        found.extend(check(cfg))
    return found


def _required_fields(cfg: VerlFlowConfig) -> list[str]:
    out = []
    if cfg.model.init == "pretrained" and not cfg.model.path:
        out.append("model.path: required when model.init is 'pretrained'")
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable is False:
        out.append(
            "critic.enable: got false, expected true or unset when algorithm.adv_estimator is 'gae' "
            "(GAE needs the critic's values)"
        )
    if cfg.ref.path and not (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward):
        out.append(
            f"ref.path: {cfg.ref.path!r} is set but nothing uses a reference "
            "(set actor.use_kl_loss or algorithm.use_kl_in_reward, or unset ref.path)"
        )
    d = cfg.data
    if d.arithmetic_tool_share and (d.arithmetic_terse_share or d.arithmetic_stop_early):
        out.append(
            f"data.arithmetic_tool_share: {d.arithmetic_tool_share:g} is a teacher of its own; "
            "expected arithmetic_terse_share and arithmetic_stop_early 0 beside it"
        )
    rc = cfg.algorithm.rollout_correction
    if cfg.actor.use_rollout_logprobs and (rc.rollout_is or rc.rollout_rs):
        out.append(
            f"algorithm.rollout_correction: rollout_is {rc.rollout_is!r}, rollout_rs {rc.rollout_rs!r} weigh "
            "π_old against the rollout's log-probs, but actor.use_rollout_logprobs=true makes them the same "
            "(the weight would be 1): turn one off"
        )
    if cfg.gate.enable:  # the gate compares registered exports by their evals
        off = [k for k, on in [("export.enable", cfg.export.enable), ("eval.enable", cfg.eval.enable),
                               ("export.register_model", cfg.export.register_model),
                               ("tracking.enabled", cfg.tracking.enabled)] if not on]  # fmt: skip
        if off:
            out.append(f"gate.enable: needs {', '.join(off)} true (it gates evaluated, registered exports)")
    return out


def _batch_sizes(cfg: VerlFlowConfig) -> list[str]:
    out = []
    prompts = cfg.data.train_batch_size
    minis = {"actor.ppo_mini_batch_size": cfg.actor.ppo_mini_batch_size}
    if cfg.use_critic:
        minis["critic.ppo_mini_batch_size"] = cfg.critic.ppo_mini_batch_size
    for name, size in minis.items():
        if prompts % size:
            out.append(f"{name}: {size} must divide data.train_batch_size ({prompts})")
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        out.append(
            f"rollout.n: {cfg.rollout.n} sample per prompt gives algorithm.adv_estimator "
            f"'{cfg.algorithm.adv_estimator}' no group baseline; expected rollout.n >= 2 "
            "(or an estimator without groups: gae, reinforce_plus_plus, remax)"
        )
    available = _training_prompts(cfg)
    if available is not None and available < prompts:
        out.append(
            f"data.train_batch_size: {prompts} prompts per iteration, but the data holds at most {available}"
        )
    return out


def _training_prompts(cfg: VerlFlowConfig) -> int | None:
    """Most training prompts the data can hold, where the config alone says (else None)."""
    d = cfg.data
    bounds = [d.max_train_samples] if d.max_train_samples else []
    if d.source == "arithmetic":
        bounds.append(d.arithmetic_train_size)
    return min(bounds) if bounds else None


def _token_budgets(cfg: VerlFlowConfig) -> list[str]:
    d = cfg.data
    sample = d.max_prompt_length + d.max_response_length
    lengths = f"data.max_prompt_length + data.max_response_length = {sample}"
    uses_ref = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    reward_model = any(s.name == "model" for s in cfg.reward.scorers)
    budgets = {  # the budgets this run uses (None: the part does not run)
        "actor.ppo_max_token_len_per_gpu": cfg.actor.ppo_max_token_len_per_gpu
        if cfg.actor.use_dynamic_bsz
        else None,
        "rollout.log_prob_max_token_len_per_gpu": cfg.rollout.log_prob_max_token_len_per_gpu,
        "sft.max_token_len_per_batch": cfg.sft.max_token_len_per_batch if cfg.sft.enable else None,
        "critic.ppo_max_token_len_per_gpu": cfg.critic.ppo_max_token_len_per_gpu if cfg.use_critic else None,
        "ref.log_prob_max_token_len_per_gpu": cfg.ref.log_prob_max_token_len_per_gpu if uses_ref else None,
        "reward.model_max_tokens_per_batch": cfg.reward.model_max_tokens_per_batch if reward_model else None,
    }
    out = [
        f"{name}: {budget} tokens cannot hold one full-length sample ({lengths}); expected >= {sample}"
        for name, budget in budgets.items()
        if budget is not None and budget < sample
    ]
    if cfg.model.init == "scratch" and sample > cfg.model.max_position_embeddings:
        out.append(
            f"model.max_position_embeddings: {cfg.model.max_position_embeddings} is shorter than the longest "
            f"sequence ({lengths})"
        )
    if cfg.reward.overlong_buffer_len > d.max_response_length:
        out.append(
            f"reward.overlong_buffer_len: {cfg.reward.overlong_buffer_len} must be <= "
            f"data.max_response_length ({d.max_response_length})"
        )
    return out


def _schedule(cfg: VerlFlowConfig) -> list[str]:
    warmup, total = cfg.trainer.critic_warmup, cfg.trainer.total_iterations
    if warmup >= total:
        return [
            f"trainer.critic_warmup: {warmup} warm-up iterations leave none of the trainer.total_iterations "
            f"({total}) to update the actor; expected < {total}"
        ]
    return []


def _dynamic_sampling(cfg: VerlFlowConfig) -> list[str]:
    est = cfg.algorithm.adv_estimator
    if cfg.algorithm.filter_groups.enable and est not in GROUP_ESTIMATORS:
        return [
            f"algorithm.filter_groups.enable: drops groups whose samples agree, which only a group-relative "
            f"estimator ({', '.join(GROUP_ESTIMATORS)}) gives no gradient; algorithm.adv_estimator is '{est}'"
        ]
    return []


def _parent(cfg: VerlFlowConfig) -> list[str]:
    """A fork or replay starts inside the planned iterations; a rescore's rewards only for a replay;
    no replay of dynamic sampling (its generation batches per iteration are the parent's sampling)."""
    p, out = cfg.parent, list[str]()
    if p is None:
        return out
    if p.iteration >= cfg.trainer.total_iterations:
        out.append(
            f"parent.iteration: {p.iteration} leaves nothing to train, expected fewer than "
            f"trainer.total_iterations ({cfg.trainer.total_iterations})"
        )
    if p.rewards is not None and not p.replay:
        out.append("parent.rewards: a rescore's rewards are read by a replay only (parent.replay=true)")
    if p.replay and cfg.algorithm.filter_groups.enable:
        out.append(
            "algorithm.filter_groups.enable: a replay does not replay dynamic sampling (the generation "
            "batches an iteration kept depend on the parent's rewards); fork the run instead"
        )
    return out


def _shared_locations(cfg: VerlFlowConfig) -> list[str]:
    """In deployments mode stages run in other processes, possibly on other machines, and meet only
    through the store (and MLflow): refuse locations only this machine can see, unless the user says
    they are on a shared filesystem."""
    if cfg.execution.mode != "deployments":
        return []
    out = []
    url = cfg.store.url
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme == "memory":
        out.append(
            f"store.url: {url!r} lives inside one process; execution.mode=deployments needs a store "
            "every worker can reach (s3://bucket/prefix)"
        )
    if scheme == "file" and not cfg.execution.shared_filesystem:
        out.append(
            f"store.url: {url!r} is local to this machine; execution.mode=deployments needs a store "
            "every worker can reach (s3://bucket/prefix), or execution.shared_filesystem=true if it is "
            "a shared mount"
        )
    uri = cfg.tracking.uri
    if (
        cfg.tracking.enabled
        and "mlflow" in cfg.tracking.backends
        and not cfg.execution.shared_filesystem
        and (uri is None or "://" not in uri or uri.startswith(("sqlite:", "file:")))
    ):
        given = "not set (the default is a sqlite file beside the store)" if uri is None else repr(uri)
        out.append(
            f"tracking.uri: {given} is a local MLflow store; execution.mode=deployments needs an MLflow "
            "server every worker can reach (http://...), or execution.shared_filesystem=true if it is a "
            "shared mount"
        )
    return out


def _distributed(cfg: VerlFlowConfig) -> list[str]:
    """An SPMD job (torchrun) that can run: sharded engines for several ranks, a rendezvous for several
    nodes, a tensor-parallel degree that divides the node and the heads, a rollout engine that does not
    generate from sharded weights."""
    out = []
    world, t, a = cfg.world_size, cfg.trainer, cfg.actor
    geometry = f"trainer.nnodes × trainer.n_gpus_per_node = {world} processes"
    placed = [("actor.strategy", a.strategy)] + (
        [("critic.strategy", cfg.critic.strategy)] if cfg.use_critic else []
    )
    if world > 1:
        out += [
            f"{name}: 'single' trains one copy per process, but {geometry}: use 'fsdp2' or 'deepspeed'"
            for name, value in placed
            if value == "single"
        ]
    if t.nnodes > 1 and not t.rdzv_endpoint:
        out.append(f"trainer.rdzv_endpoint: required (host:port of node 0) when trainer.nnodes is {t.nnodes}")
    tp = a.tensor_parallel_size
    if tp > 1:
        if a.strategy != "fsdp2":
            out.append(f"actor.tensor_parallel_size: {tp} needs actor.strategy 'fsdp2', got {a.strategy!r}")
        if t.n_gpus_per_node % tp:
            out.append(
                f"actor.tensor_parallel_size: {tp} does not divide trainer.n_gpus_per_node "
                f"{t.n_gpus_per_node} (tensor-parallel groups stay inside a node)"
            )
        m = cfg.model
        if m.init == "scratch" and (m.num_attention_heads % tp or m.num_key_value_heads % tp):
            out.append(
                f"actor.tensor_parallel_size: {tp} does not divide model.num_attention_heads "
                f"{m.num_attention_heads} and model.num_key_value_heads {m.num_key_value_heads}"
            )
    for section, strategy, offload in (
        ("actor", a.strategy, a.param_offload),
        ("critic", cfg.critic.strategy, cfg.critic.param_offload and cfg.use_critic),
        ("ref", cfg.ref.strategy, cfg.ref.param_offload),
    ):
        if offload and strategy != "fsdp2":
            out.append(f"{section}.param_offload: needs {section}.strategy 'fsdp2', got {strategy!r}")
    r = cfg.rollout
    if r.name == "vllm" and world > 1 and t.n_gpus_per_node % r.tensor_parallel_size:
        out.append(
            f"rollout.tensor_parallel_size: {r.tensor_parallel_size} does not divide trainer.n_gpus_per_node "
            f"{t.n_gpus_per_node} (a vLLM engine spans ranks of one node)"
        )
    sharded = [name for name, value in placed if value != "single"]
    if sharded and cfg.model.lora_rank:
        out.append(
            f"model.lora_rank: LoRA with {' and '.join(sharded)} {a.strategy!r} is not supported yet "
            "(train LoRA with strategy 'single', or full weights sharded)"
        )
    if cfg.rollout.name in ("hf", "auto") and cfg.rollout.share_weights and a.strategy != "single":
        out.append(
            f"rollout.share_weights: the hf engine cannot generate from the actor's sharded weights "
            f"(actor.strategy {a.strategy!r}): set rollout.share_weights=false (its own full copy, synced "
            "after every update)"
        )
    return out


def _overlap(cfg: VerlFlowConfig) -> list[str]:
    """An ahead rollout (``trainer.rollout_ahead=1``) samples an engine holding its own weights, in one
    process."""
    out, t = [], cfg.trainer
    if t.rollout_ahead and cfg.rollout.name == "hf" and cfg.rollout.share_weights:
        out.append(
            "trainer.rollout_ahead: 1 needs an engine with its own weights: rollout.share_weights=false"
        )
    if t.rollout_ahead and cfg.world_size > 1:
        out.append(f"trainer.rollout_ahead: 1 runs in one process for now, not {cfg.world_size}: set it to 0")
    if t.rollout_ahead and cfg.algorithm.filter_groups.enable:
        out.append(
            "trainer.rollout_ahead: 1 does not sample ahead in generation batches yet: set it to 0 with "
            "algorithm.filter_groups.enable=true"
        )
    return out


def _precision(cfg: VerlFlowConfig) -> list[str]:
    """``model.dtype`` is the dtype of the stored (master) weights and the optimizer state;
    ``<role>.mixed_precision.param_dtype`` the dtype the forward/backward compute in. Neither overrides
    the other; fp32 compute from bf16 master weights is refused (it buys no precision: the update is
    rounded to bf16 when stored). Liger's kernels are Triton: CUDA only."""
    out = []
    roles = {"actor": cfg.actor.mixed_precision, "critic": cfg.critic.mixed_precision}
    roles["ref"] = cfg.ref.mixed_precision
    for role, mp in roles.items():
        if mp.param_dtype == "float32" and cfg.model.dtype == "bfloat16":
            out.append(
                f"{role}.mixed_precision.param_dtype: float32 with model.dtype bfloat16 computes in fp32 "
                "from bf16 master weights; for fp32 master weights and bf16 compute set model.dtype=float32 "
                f"and {role}.mixed_precision.param_dtype=bfloat16"
            )
    lora_ref = cfg.model.lora_rank > 0 and cfg.ref.path is None
    if lora_ref and cfg.ref.mixed_precision.param_dtype is not None:
        out.append(
            "ref.mixed_precision.param_dtype: the reference of a LoRA actor without ref.path is the actor "
            "with its adapters off and computes as actor.mixed_precision says; unset it"
        )
    if cfg.model.use_liger and cfg.trainer.device == "cpu":
        out.append(
            "model.use_liger: true needs a CUDA device (liger's kernels are Triton), not trainer.device=cpu"
        )
    if cfg.model.torch_compile and cfg.model.attn_implementation == "eager":
        out.append(
            "model.torch_compile: compiles the packed forwards of sdpa and flash_attention_2 models; "
            "model.attn_implementation=eager has none (set it to sdpa)"
        )
    if cfg.model.torch_compile:
        untested = [
            f"{r}.strategy deepspeed" for r in ("actor", "critic") if getattr(cfg, r).strategy == "deepspeed"
        ]
        if cfg.actor.tensor_parallel_size > 1:
            untested.append(f"actor.tensor_parallel_size {cfg.actor.tensor_parallel_size}")
        if untested:
            out.append(
                f"model.torch_compile: not tested with {', '.join(untested)} (ZeRO's parameter hooks, "
                "DTensor projections); turn it off there"
            )
    cxx = os.environ.get("CXX", "g++")
    if cfg.model.torch_compile and cfg.trainer.device == "cpu" and not shutil.which(cxx.split()[-1]):
        out.append(
            f"model.torch_compile: true on trainer.device=cpu needs a C++ compiler for inductor's CPU "
            f"code, and {cxx!r} (the CXX environment variable, default g++) is not on PATH"
        )
    return out


# Unit roundoff u of each model.dtype: bf16 keeps 8 significant bits, fp32 24. A stored weight w has a
# spacing between u·|w| and 2u·|w| to its neighbours; round-to-nearest loses an update below half of it.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float32": 2.0**-24}
# The small end of the weights an update must move: Qwen2/Llama configs initialise projections with
# std 0.02 (initializer_range) and norms at 1.
SMALL_WEIGHT = 1e-2


def _update_below_rounding(cfg: VerlFlowConfig) -> list[str]:
    """AdamW moves each weight by about ``lr`` per step (its normalised update m̂/(√v̂+ε) is at most
    about 1 in size, ±1 on the first step). Stored in ``model.dtype`` without higher-precision
    masters, a weight |w| changes only when that step reaches its rounding, ≈ u·|w|. Refused when
    ``lr < u · SMALL_WEIGHT`` (bf16: 2^-8 × 0.01 ≈ 3.9e-5): then not even weights of |w| = 0.01 move
    reliably, and larger ones not at all (pure bf16 at lr 1e-6 changes about 2% of the weights in 10
    steps). A floor, not a guarantee: above it weights larger than lr/u still round away, which is
    why training keeps fp32 master weights (verl's recipe). LoRA adapters are fp32 whatever
    ``model.dtype`` is (PEFT upcasts them), so a LoRA actor/SFT is not checked; the critic is."""
    u = UNIT_ROUNDOFF[cfg.model.dtype]
    floor = u * SMALL_WEIGHT
    full = cfg.model.lora_rank == 0
    trained = {  # lr field → the section whose mixed_precision computes it (None: not trained here)
        "actor.lr": (cfg.actor.lr, "actor" if full else None),
        "sft.lr": (cfg.sft.lr, "actor" if full and cfg.sft.enable else None),
        "critic.lr": (cfg.critic.lr, "critic" if cfg.use_critic else None),
    }
    return [
        f"{field}: {lr:g} is below the rounding of model.dtype {cfg.model.dtype} weights (AdamW moves a "
        f"weight by ≈ lr per step; refused below {u:.3g} × {SMALL_WEIGHT:g} = {floor:.2g}), most weights "
        f"would not change: keep fp32 master weights and compute in bf16 (model.dtype=float32 "
        f"{section}.mixed_precision.param_dtype=bfloat16)"
        for field, (lr, section) in trained.items()
        if section is not None and lr < floor
    ]


def advice(cfg: VerlFlowConfig) -> list[str]:
    """Lines for a config that can run but probably does not do what its author wants (empty: none)."""
    found: list[str] = []
    for check in ADVICE:
        found.extend(check(cfg))
    return found


def _scratch_learning_rate(cfg: VerlFlowConfig) -> list[str]:
    lr = cfg.actor.lr
    if cfg.model.init != "scratch" or lr >= SCRATCH_MIN_ACTOR_LR:
        return []
    return [
        f"actor.lr: {lr:g} with model.init 'scratch' is a pretrained model's learning rate (the default "
        f"1e-06 is verl's for a pretrained 0.5B model) and barely moves a model trained from scratch; "
        f"the CPU quickstarts use actor.lr {QUICKSTART_ACTOR_LR:g} (warned below {SCRATCH_MIN_ACTOR_LR:g})"
    ]


ADVICE: tuple[Callable[[VerlFlowConfig], list[str]], ...] = (_scratch_learning_rate, inert_settings)


CHECKS: tuple[Callable[[VerlFlowConfig], list[str]], ...] = (
    _required_fields,
    _batch_sizes,
    _token_budgets,
    _schedule,
    _dynamic_sampling,
    _parent,
    _shared_locations,
    _distributed,
    _overlap,
    _precision,
    _update_below_rounding,
)
