"""verl's config names → verl-flow's: one table, read by the loader (overrides and YAML written with
verl's key paths) and by ``verl-flow from-verl``.

Each verl key is one of:

- **renamed** (:data:`RENAMED`, :data:`RENAMED_PREFIXES` for the keys of a free dict, and
  :data:`SECTIONS` for keys whose remainder is one of our fields of the same meaning,
  ``actor_rollout_ref.actor.clip_ratio`` → ``actor.clip_ratio``): same value;
- **converted** (:data:`CONVERTED`): the value becomes one or more of our settings, and the entry says
  what differs (``trainer.logger=['console','wandb']`` → ``tracking.backends=[wandb]``);
- **built in** (:data:`BUILT_IN`): what verl-flow always does; accepted with that value, refused with another;
- **dropped** (:data:`DROPPED`, a key or a prefix ending in ``.``): no counterpart; the entry says why and
  what to use instead. The loader refuses it; ``from-verl`` lists it.

A key of ours is read as ours, unless :data:`CONVERTED` names it (verl's ``trainer.save_freq=-1``).
Suggestions for an unknown key never cross a known confusion (:data:`CONFUSIONS`: micro vs mini
batches, sample counts vs token budgets, ...): a near name with another meaning is no help. The table
is read by :mod:`.verl_translate`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import yaml

# A conversion: (the value as text, every verl key given with its text) → our (key, value text) pairs.
Conversion = Callable[[str, Mapping[str, str]], list[tuple[str, str]]]


class Refused(ValueError):
    """Raised by a conversion for a value that has no counterpart here; the message says why and what
    to use instead (the key is then dropped, as a :data:`DROPPED` one)."""


# verl section → ours, for keys whose remainder is a field of ours with the same meaning
SECTIONS: dict[str, str] = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.ref.": "ref.",
    "actor_rollout_ref.model.": "model.",
}

_ACTOR, _ROLLOUT, _REF, _MODEL = SECTIONS  # the verl prefixes, in SECTIONS' order

RENAMED: dict[str, str] = {
    f"{_ACTOR}optim.lr": "actor.lr",
    f"{_ACTOR}optim.weight_decay": "actor.weight_decay",
    f"{_ACTOR}optim.lr_warmup_steps_ratio": "actor.warmup_steps_ratio",
    f"{_ACTOR}optim.clip_grad": "actor.grad_clip",
    f"{_ACTOR}policy_loss.loss_mode": "actor.policy_loss",
    f"{_ACTOR}fsdp_config.mixed_precision.param_dtype": "actor.mixed_precision.param_dtype",
    f"{_ACTOR}fsdp_config.mixed_precision.reduce_dtype": "actor.mixed_precision.reduce_dtype",
    f"{_ACTOR}fsdp_config.mixed_precision.buffer_dtype": "actor.mixed_precision.buffer_dtype",
    f"{_ROLLOUT}tensor_model_parallel_size": "rollout.tensor_parallel_size",
    f"{_ROLLOUT}enforce_eager": "rollout.vllm_enforce_eager",
    f"{_ROLLOUT}val_kwargs.n": "rollout.val_n",
    f"{_ROLLOUT}multi_turn.max_assistant_turns": "rollout.multi_turn.max_turns",
    f"{_MODEL}enable_gradient_checkpointing": "model.gradient_checkpointing",
    "critic.model.path": "critic.path",
    "critic.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "critic.optim.lr": "critic.lr",
    "critic.optim.weight_decay": "critic.weight_decay",
    "critic.optim.clip_grad": "critic.grad_clip",
    "critic.model.fsdp_config.mixed_precision.param_dtype": "critic.mixed_precision.param_dtype",
    "data.train_max_samples": "data.max_train_samples",
    "data.val_max_samples": "data.max_val_samples",
    "reward_model.model.path": "reward.model_path",
    "trainer.total_training_steps": "trainer.total_iterations",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    "custom_reward_function.reward_kwargs": "reward.function_kwargs",
}

# verl prefix → ours, for the keys of a dict of free keys (Hydra's
# +custom_reward_function.reward_kwargs.alpha=0.5, or that dict in a YAML file): same value
RENAMED_PREFIXES: dict[str, str] = {
    "custom_reward_function.reward_kwargs.": "reward.function_kwargs.",
}

_COMPUTED = "verl-flow computes it"
_VLLM_OWN = "a vLLM engine setting verl-flow chooses itself (verl_core.rollout.vllm_spec)"
_TOKENS = (
    "verl-flow cuts {what} micro-batches by token budget, not by count: set {ours} (tokens per micro-batch)"
)
_FSDP = (
    "fsdp2 shards every decoder layer over all ranks; there is no wrap policy, group size or prefetch to set"
)

DROPPED: dict[str, str] = {
    # micro-batch counts where verl-flow has token budgets (a count is not a budget: no conversion)
    f"{_ROLLOUT}log_prob_micro_batch_size_per_gpu": _TOKENS.format(
        what="log-prob", ours="rollout.log_prob_max_token_len_per_gpu"
    ),
    f"{_ROLLOUT}log_prob_micro_batch_size": _TOKENS.format(
        what="log-prob", ours="rollout.log_prob_max_token_len_per_gpu"
    ),
    f"{_REF}log_prob_micro_batch_size_per_gpu": _TOKENS.format(
        what="reference", ours="ref.log_prob_max_token_len_per_gpu"
    ),
    f"{_REF}log_prob_micro_batch_size": _TOKENS.format(
        what="reference", ours="ref.log_prob_max_token_len_per_gpu"
    ),
    "critic.ppo_micro_batch_size_per_gpu": _TOKENS.format(
        what="critic", ours="critic.ppo_max_token_len_per_gpu"
    ),
    "critic.ppo_micro_batch_size": _TOKENS.format(what="critic", ours="critic.ppo_max_token_len_per_gpu"),
    "critic.forward_micro_batch_size_per_gpu": _TOKENS.format(
        what="critic", ours="critic.ppo_max_token_len_per_gpu"
    ),
    "critic.forward_max_token_len_per_gpu": "the critic's forwards use critic.ppo_max_token_len_per_gpu",
    "reward_model.micro_batch_size_per_gpu": _TOKENS.format(
        what="reward-model", ours="reward.model_max_tokens_per_batch"
    ),
    f"{_ACTOR}ppo_micro_batch_size": f"a global count; set {_ACTOR}ppo_micro_batch_size_per_gpu",
    # schedules verl-flow computes
    f"{_ACTOR}optim.total_training_steps": f"{_COMPUTED} from trainer.total_iterations",
    "critic.optim.total_training_steps": f"{_COMPUTED} from trainer.total_iterations",
    f"{_ACTOR}optim.lr_warmup_steps": "set actor.warmup_steps_ratio (a fraction of the updates)",
    "critic.optim.lr_warmup_steps_ratio": "the critic has no warm-up in verl-flow (constant learning rate)",
    "critic.optim.lr_warmup_steps": "the critic has no warm-up in verl-flow (constant learning rate)",
    f"{_ACTOR}optim.min_lr_ratio": "the cosine schedule decays to 0",
    f"{_ACTOR}optim.betas": "AdamW with torch's betas (0.9, 0.999), as verl's default",
    # placement details verl-flow decides
    f"{_ACTOR}fsdp_config.fsdp_size": _FSDP,
    f"{_ACTOR}fsdp_config.wrap_policy.": _FSDP,
    f"{_ACTOR}fsdp_config.reshard_after_forward": _FSDP,
    f"{_ACTOR}fsdp_config.forward_prefetch": _FSDP,
    f"{_ACTOR}fsdp_config.offload_policy": "actor.param_offload offloads parameters, gradients and optimizer",
    f"{_ACTOR}ulysses_sequence_parallel_size": "no sequence parallelism: sequences are packed per rank",
    f"{_ACTOR}checkpoint.": "a checkpoint always holds the model, the optimizer and the trainer state",
    f"{_ACTOR}profiler.": "per-stage and per-phase timings are logged every iteration (no profiler hooks)",
    f"{_ACTOR}use_torch_compile": "verl compiles its entropy kernel; model.torch_compile compiles layers",
    f"{_ACTOR}entropy_from_logits_with_chunking": "no counterpart (entropy computed per packed micro-batch)",
    f"{_ACTOR}entropy_checkpointing": "no counterpart (entropy computed per packed micro-batch)",
    f"{_ACTOR}shuffle": "no counterpart: mini-batches are taken in rollout order",
    f"{_REF}ulysses_sequence_parallel_size": "no sequence parallelism: sequences are packed per rank",
    "critic.ulysses_sequence_parallel_size": "no sequence parallelism: sequences are packed per rank",
    "critic.model.tokenizer_path": "the critic uses the policy's tokenizer",
    "critic.checkpoint.": "a checkpoint always holds the model, the optimizer and the trainer state",
    "critic.profiler.": "per-stage and per-phase timings are logged every iteration (no profiler hooks)",
    # the rollout engine
    f"{_ROLLOUT}load_format": _VLLM_OWN,
    f"{_ROLLOUT}layered_summon": "LoRA weights reach vLLM as an adapter (no layered gather to choose)",
    f"{_ROLLOUT}free_cache_engine": _VLLM_OWN,
    f"{_ROLLOUT}max_num_batched_tokens": _VLLM_OWN,
    f"{_ROLLOUT}max_num_seqs": _VLLM_OWN,
    f"{_ROLLOUT}enable_chunked_prefill": _VLLM_OWN,
    f"{_ROLLOUT}enable_prefix_caching": _VLLM_OWN,
    f"{_ROLLOUT}disable_log_stats": _VLLM_OWN,
    f"{_ROLLOUT}dtype": "the engine computes in actor.mixed_precision.param_dtype, else model.dtype",
    f"{_ROLLOUT}prompt_length": "set data.max_prompt_length",
    f"{_ROLLOUT}response_length": "set data.max_response_length",
    f"{_ROLLOUT}val_kwargs.top_p": "validation samples at rollout.val_temperature with the rollout's top_p",
    f"{_ROLLOUT}val_kwargs.top_k": "validation samples at rollout.val_temperature with the rollout's top_k",
    f"{_ROLLOUT}multi_turn.tool_config_path": "list tool names in rollout.multi_turn.tools",
    f"{_ROLLOUT}calculate_log_probs": "set actor.use_rollout_logprobs to train on the engine's log-probs",
    f"{_ROLLOUT}agent.": "multi-turn rollouts are rollout.multi_turn (no agent loop classes)",
    f"{_MODEL}use_shm": "the model is read from model.path as given",
    f"{_MODEL}external_lib": "no counterpart: architectures come from transformers",
    f"{_MODEL}custom_chat_template": "set data.chat_template (a named built-in or the tokenizer's own)",
    f"{_MODEL}lora_adapter_path": "start from an adapter through a fork (verl-flow run --fork RUN@ITER)",
    f"{_MODEL}exclude_modules": "set model.target_modules to the modules that get adapters",
    "critic.model.lora_rank": "the critic trains full weights",
    # data
    "data.tokenizer": "the tokenizer is the model's (model.path)",
    "data.reward_fn_key": "scorers read data_source",
    "data.val_batch_size": "validation runs the whole held-out set in engine batches",
    "data.dataloader_num_workers": "no counterpart: prompts are read from the prepared Parquet artifact",
    "data.filter_overlong_prompts_workers": "no counterpart: prompts are cleaned in one pass",
    "data.custom_cls.": "set data.source (gsm8k, arithmetic, jsonl, parquet, hf) and the *_key fields",
    "data.image_key": "text only",
    # reward
    "reward_model.strategy": "the reward model runs in the reward stage (reward.model_device)",
    "reward_model.model.input_tokenizer": "the reward model's own tokenizer is used",
    "reward_model.sandbox_fusion.": "code is scored in a local sandbox (reward.scorers=[code], sandbox.*)",
    "reward_model.launch_reward_fn_async": "rewards are their own stage",
    # the trainer
    "trainer.default_local_dir": "checkpoints live in the artifact store (store.url)",
    "trainer.default_hdfs_dir": "checkpoints live in the artifact store (store.url)",
    "trainer.resume_from_path": "resume a run by its id (verl-flow run --run-id); branch: --fork RUN@ITER",
    "trainer.log_val_generations": "set tracking.log_samples",
    "trainer.rollout_data_dir": "every rollout is an artifact of the run (verl-flow runs show)",
    "trainer.validation_data_dir": "every validation is an artifact of the run (verl-flow runs show)",
    "trainer.ray_wait_register_center_timeout": "no Ray",
    "trainer.use_legacy_worker_impl": "no worker classes to choose",
    "trainer.esi_redundant_time": "no counterpart",
    "trainer.del_local_ckpt_after_load": "no counterpart",
    "trainer.val_only": "evaluate a run's policy with verl-flow eval",
    "algorithm.use_pf_ppo": "no counterpart",
    "algorithm.pf_ppo.": "no counterpart",
    "global_profiler.": "per-stage and per-phase timings are logged every iteration (no profiler hooks)",
    "ray_kwargs.": "no Ray: stages run in Prefect (execution.*), training jobs under torchrun",
    "ray_init.": "no Ray: stages run in Prefect (execution.*), training jobs under torchrun",
    "transfer_queue.": "stages exchange Parquet artifacts",
}

# verl key → (the value verl-flow always behaves as, why): accepted with that value, refused otherwise
BUILT_IN: dict[str, tuple[object, str]] = {
    f"{_MODEL}use_remove_padding": (True, "sequences are always packed without padding"),
    "critic.model.use_remove_padding": (True, "sequences are always packed without padding"),
    "reward_model.model.use_remove_padding": (True, "sequences are always packed without padding"),
    f"{_ROLLOUT}log_prob_use_dynamic_bsz": (True, "log-prob micro-batches are token budgets"),
    f"{_REF}log_prob_use_dynamic_bsz": (True, "reference micro-batches are token budgets"),
    "critic.use_dynamic_bsz": (True, "critic micro-batches are token budgets"),
    "reward_model.use_dynamic_bsz": (True, "reward-model micro-batches are token budgets"),
    f"{_ROLLOUT}do_sample": (True, "set rollout.temperature=0 for greedy training rollouts"),
    f"{_ROLLOUT}mode": ("async", "the engine is driven by the rollout stage"),
    "actor_rollout_ref.hybrid_engine": (True, "trainer and rollout engine share the devices"),
    f"{_ACTOR}optim.optimizer": ("AdamW", "the optimizer is AdamW"),
    "critic.optim.optimizer": ("AdamW", "the optimizer is AdamW"),
    f"{_ACTOR}fsdp_config.optimizer_offload": (
        False,
        "set actor.param_offload=true: it offloads parameters, gradients and optimizer state together",
    ),
    "critic.model.fsdp_config.optimizer_offload": (
        False,
        "set critic.param_offload=true: it offloads parameters, gradients and optimizer state together",
    ),
    f"{_REF}fsdp_config.optimizer_offload": (False, "the reference has no optimizer"),
    "trainer.balance_batch": (True, "micro-batches are balanced by token count"),
    "data.return_raw_input_ids": (False, "prompts are tokenized by the policy's tokenizer"),
    "data.return_raw_chat": (True, "prompts are kept as chat messages"),
}


# --------------------------------------------------------------------------------------------------
# Conversions: the value's meaning differs


def load_value(text: str) -> object:
    """A value's text as YAML reads it (the text itself when it is not YAML)."""
    try:
        return yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


def _flag(text: str) -> bool:
    return load_value(text) is True


def _as_list(text: str) -> str:
    """verl accepts one path for a list of files; ours is always a list."""
    value = load_value(text)
    items = value if isinstance(value, list) else [text]
    return yaml.safe_dump([str(v) for v in items], default_flow_style=True).strip()


def _logger(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl's logger list → tracking: console is always on; mlflow and wandb are backends."""
    value = load_value(text)
    names = [str(v) for v in (value if isinstance(value, list) else [value])]
    backends = [n for n in names if n in ("mlflow", "wandb")]
    if not backends:
        return [("tracking.enabled", "false")]
    return [("tracking.enabled", "true"), ("tracking.backends", f"[{', '.join(backends)}]")]


def _freq(ours: str) -> Conversion:
    """verl's -1 (never) is verl-flow's 0 (never validate; checkpoint only at the end)."""

    def convert(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
        value = load_value(text)
        return [(ours, "0" if isinstance(value, int) and value < 0 else text)]

    return convert


def _model_path(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl always loads a pretrained model; verl-flow builds one from scratch unless told."""
    return [("model.path", text), ("model.init", "pretrained")]


def _micro(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl's actor counts samples per micro-batch unless use_dynamic_bsz is on (its default: off);
    verl-flow's default is token budgets, so a count given alone turns them off."""
    out = [("actor.ppo_micro_batch_size_per_gpu", text)]
    if f"{_ACTOR}use_dynamic_bsz" not in given and "actor.use_dynamic_bsz" not in given:
        out.append(("actor.use_dynamic_bsz", "false"))
    return out


def _offload(section: str) -> Conversion:
    """verl offloads FSDP shards; verl-flow's offload is of fsdp2 shards, so it sets the strategy."""

    def convert(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
        if not _flag(text):
            return [(f"{section}.param_offload", "false")]
        if section == "ref" and _lora(given):
            return []  # a LoRA run's reference is the base without adapters: nothing to offload
        return [(f"{section}.param_offload", "true"), (f"{section}.strategy", "fsdp2")]

    return convert


def _lora(given: Mapping[str, str]) -> bool:
    rank = load_value(given.get(f"{_MODEL}lora_rank", given.get("model.lora_rank", "0")))
    return isinstance(rank, int) and rank > 0


def _strategy(section: str) -> Conversion:
    """verl's fsdp and fsdp2 are verl-flow's fsdp2; megatron has no counterpart (refused by the schema)."""

    def convert(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
        return [(f"{section}.strategy", "fsdp2" if text in ("fsdp", "fsdp2") else text)]

    return convert


def _dtype(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl's short dtype names (fp32, bf16) → the names the schema takes."""
    return [("model.dtype", {"fp32": "float32", "bf16": "bfloat16"}.get(text, text))]


def _filter_overlong(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl drops prompts over data.max_prompt_length when they are loaded: verl-flow's truncation=drop."""
    return [("data.truncation", "drop")] if _flag(text) else []


def _truncation(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """With filter_overlong_prompts on, verl never truncates a prompt: drop wins whatever the order."""
    return [] if _flag(given.get("data.filter_overlong_prompts", "false")) else [("data.truncation", text)]


def _reward_model(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl's reward model replaces the rule score when enabled: the model is the only scorer."""
    return [("reward.scorers", "[model]")] if _flag(text) else []


def _reward_fn(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl's custom function file and name → ``reward.function='FILE:NAME'``, the only scorer."""
    if load_value(text) is None:
        return []
    name = given.get("custom_reward_function.name", "compute_score")
    return [("reward.function", f"{text}:{name}"), ("reward.scorers", "[function]")]


def _reward_fn_name(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """The name goes with custom_reward_function.path (read there); without a path verl ignores it."""
    return []


# verl's reward manager → how our function scorer calls the custom function (reward.function_mode)
REWARD_MANAGERS = {"naive": "sample", "batch": "batch"}


def _reward_manager(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl's naive manager calls compute_score once per sample, its batch manager once per batch with
    lists: reward.function_mode. Its other managers (dapo, prime, ...) are refused."""
    name = str(load_value(text))
    if name not in REWARD_MANAGERS:
        raise Refused(
            f"verl's {name!r} reward manager has no counterpart: use naive (reward.function_mode=sample) "
            "or batch (reward.function_mode=batch); DAPO's overlong penalty is reward.overlong_buffer_len "
            "(reward_model.overlong_buffer.*), parallel scoring reward.num_workers"
        )
    return [("reward.function_mode", REWARD_MANAGERS[name])]


def _val_sampling(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """verl validates greedily unless val_kwargs.do_sample is on, whatever its temperature: verl-flow's
    validation temperature alone says it (0: greedy)."""
    if not _flag(given.get(f"{_ROLLOUT}val_kwargs.do_sample", "false")):
        return [("rollout.val_temperature", "0")]
    return [("rollout.val_temperature", given.get(f"{_ROLLOUT}val_kwargs.temperature", "0"))]


def _overlong(text: str, given: Mapping[str, str]) -> list[tuple[str, str]]:
    """DAPO's overlong buffer (reward_model.overlong_buffer.{enable,len,penalty_factor}): verl-flow's
    penalty is on when reward.overlong_buffer_len > 0."""
    prefix = "reward_model.overlong_buffer."
    if not _flag(given.get(prefix + "enable", "false")):
        return [("reward.overlong_buffer_len", "0")]
    return [
        ("reward.overlong_buffer_len", given.get(prefix + "len", "0")),
        ("reward.overlong_penalty_factor", given.get(prefix + "penalty_factor", "1.0")),
    ]


def _files(ours: str) -> Conversion:
    return lambda text, given: [(ours, _as_list(text))]


# verl key → (conversion, what differs)
CONVERTED: dict[str, tuple[Conversion, str]] = {
    "trainer.logger": (
        _logger,
        "console is always on; mlflow/wandb become tracking.backends, others are dropped",
    ),
    "trainer.save_freq": (_freq("trainer.save_freq"), "verl's -1 (never) is 0 here (only at the end)"),
    "trainer.test_freq": (_freq("trainer.test_freq"), "verl's -1 (never) is 0 here"),
    "data.train_files": (_files("data.train_files"), "a list of files"),
    "data.val_files": (_files("data.val_files"), "a list of files"),
    "data.filter_overlong_prompts": (_filter_overlong, "overlong prompts dropped: data.truncation=drop"),
    "data.truncation": (_truncation, "ignored when data.filter_overlong_prompts is on (drop wins)"),
    f"{_MODEL}path": (_model_path, "verl always loads pretrained weights: model.init=pretrained"),
    f"{_ACTOR}ppo_micro_batch_size_per_gpu": (
        _micro,
        "a count applies only without token budgets: actor.use_dynamic_bsz=false unless given",
    ),
    f"{_ACTOR}fsdp_config.param_offload": (
        _offload("actor"),
        "offload needs fsdp2 here: actor.strategy=fsdp2",
    ),
    "critic.model.fsdp_config.param_offload": (
        _offload("critic"),
        "offload needs fsdp2 here: critic.strategy=fsdp2",
    ),
    f"{_REF}fsdp_config.param_offload": (
        _offload("ref"),
        "offload needs fsdp2 here: ref.strategy=fsdp2; nothing to offload under LoRA (the ref is the base)",
    ),
    f"{_ACTOR}strategy": (_strategy("actor"), "verl's fsdp/fsdp2 are fsdp2 here"),
    "critic.strategy": (_strategy("critic"), "verl's fsdp/fsdp2 are fsdp2 here"),
    f"{_REF}strategy": (_strategy("ref"), "verl's fsdp/fsdp2 are fsdp2 here"),
    f"{_ACTOR}fsdp_config.model_dtype": (_dtype, "parameter dtype of the model: model.dtype"),
    "reward_model.enable": (_reward_model, "the reward model is the only scorer: reward.scorers=[model]"),
    "custom_reward_function.path": (_reward_fn, "FILE:NAME in reward.function, the only scorer"),
    "custom_reward_function.name": (_reward_fn_name, "read with custom_reward_function.path"),
    "reward_model.reward_manager": (
        _reward_manager,
        "how the custom function is called: naive → reward.function_mode=sample, batch → batch",
    ),
    f"{_ROLLOUT}val_kwargs.do_sample": (_val_sampling, "greedy unless do_sample: rollout.val_temperature"),
    f"{_ROLLOUT}val_kwargs.temperature": (_val_sampling, "applies only with val_kwargs.do_sample=True"),
    "reward_model.overlong_buffer.enable": (_overlong, "DAPO's overlong penalty: reward.overlong_buffer_len"),
    "reward_model.overlong_buffer.len": (_overlong, "applies only with overlong_buffer.enable=True"),
    "reward_model.overlong_buffer.penalty_factor": (
        _overlong,
        "applies only with overlong_buffer.enable=True",
    ),
}

# Words that name different things although the names around them are alike: a suggestion that swaps
# one for the other changes the meaning (ppo_micro_batch_size_per_gpu is not ppo_mini_batch_size).
CONFUSIONS: tuple[tuple[str, str], ...] = (
    ("micro", "mini"),
    ("batch_size", "token_len"),
    ("batch_size", "tokens"),
    ("epochs", "iterations"),
    ("epochs", "steps"),
    ("prompt", "response"),
    ("train", "val"),
    ("low", "high"),
    ("param", "optimizer"),
    ("min", "max"),
    ("batch_size", "epochs"),
    ("batch_size", "freq"),
)
