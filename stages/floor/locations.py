"""Stage locations: the names of a run's stages, built and parsed here and nowhere else.

    preprocess, template_pack, sft, sft-ckpt, report       one per run
    iter-XXXX/{rollout,reward,update,val}                  per RL iteration (XXXX: 4+ digits)
    iter-XXXX/{rollout,reward}/gen-K                       generation batch K of an iteration (dynamic
                                                           sampling, algorithm.filter_groups)
    ckpt/iter-XXXX                                         RL checkpoint after XXXX updates
    export/iter-XXXX, export/sft                           merged HF export of a policy
    eval/{label}                                           evaluation of a policy
    gate                                                   the champion/challenger decision on the eval
    rescore/{name}/{stage}                                 a rescore of ``stage``'s rollouts (its reward,
                                                           val or eval stage) with other reward settings
    rescore/{name}/report                                  that rescore's comparison report

Every ``parse_*`` function returns None for a name that is not of its kind.
"""

from __future__ import annotations

import re
from typing import Any, Literal, NamedTuple, cast, get_args

from verl_core.errors import ArtifactNotFoundError, ConfigError
from verl_core.store import ArtifactStore, Manifest

IterationKind = Literal["rollout", "reward", "update", "val"]
ITERATION_KINDS: tuple[IterationKind, ...] = get_args(IterationKind)
GenerationKind = Literal["rollout", "reward"]
GENERATION_KINDS: tuple[GenerationKind, ...] = get_args(GenerationKind)

PREPROCESS = "preprocess"
TEMPLATE_PACK = "template_pack"
SFT = "sft"
SFT_CKPT = "sft-ckpt"
REPORT = "report"
RESCORE = "rescore"
GATE = "gate"

_ITERATION = re.compile(r"^iter-(\d{4,})/(rollout|reward|update|val)$")
_GENERATION = re.compile(r"^iter-(\d{4,})/(rollout|reward)/gen-(\d+)$")
_CKPT = re.compile(r"^ckpt/iter-(\d{4,})$")
_EXPORT = re.compile(r"^export/(?:iter-(\d{4,})|(sft))$")
_RESCORE_NAME = re.compile(r"^[A-Za-z0-9_.=-]+$")
_RESCORE = re.compile(r"^rescore/([A-Za-z0-9_.=-]+)/(.+)$")
_EVAL = re.compile(r"^eval/([^/]+)$")


def _iter(iteration: int) -> str:
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter-{iteration:04d}"


def iteration_stage(iteration: int, kind: IterationKind) -> str:
    """``iteration_stage(3, "reward") == "iter-0003/reward"``."""
    if kind not in ITERATION_KINDS:
        raise ValueError(f"iteration stage kind must be one of {ITERATION_KINDS}, got {kind!r}")
    return f"{_iter(iteration)}/{kind}"


def parse_iteration_stage(name: str) -> tuple[int, IterationKind] | None:
    """``"iter-0003/reward"`` → ``(3, "reward")``; None for any other name."""
    m = _ITERATION.match(name)
    return (int(m.group(1)), cast(IterationKind, m.group(2))) if m else None


def generation_stage(iteration: int, kind: GenerationKind, gen: int) -> str:
    """``generation_stage(3, "reward", 1) == "iter-0003/reward/gen-1"``: generation batch ``gen`` of an
    iteration that samples until its batch holds enough informative groups."""
    if kind not in GENERATION_KINDS:
        raise ValueError(f"generation stage kind must be one of {GENERATION_KINDS}, got {kind!r}")
    if gen < 0:
        raise ValueError(f"generation batch must be >= 0, got {gen}")
    return f"{_iter(iteration)}/{kind}/gen-{gen}"


def parse_generation_stage(name: str) -> tuple[int, GenerationKind, int] | None:
    """``"iter-0003/reward/gen-1"`` → ``(3, "reward", 1)``; None for any other name."""
    m = _GENERATION.match(name)
    return (int(m.group(1)), cast(GenerationKind, m.group(2)), int(m.group(3))) if m else None


def ckpt_stage(iteration: int) -> str:
    """``ckpt_stage(2) == "ckpt/iter-0002"``: the RL checkpoint after ``iteration`` updates."""
    return f"ckpt/{_iter(iteration)}"


def parse_ckpt_stage(name: str) -> int | None:
    """``"ckpt/iter-0002"`` → 2; None for any other name."""
    m = _CKPT.match(name)
    return int(m.group(1)) if m else None


def export_stage(policy_stage: str) -> str:
    """The export of a policy stage: ``ckpt/iter-0002`` → ``export/iter-0002``, ``sft`` → ``export/sft``."""
    if policy_stage == SFT:
        return "export/sft"
    iteration = parse_ckpt_stage(policy_stage)
    if iteration is None:
        raise ValueError(f"only a checkpoint (ckpt/iter-XXXX) or sft is exported, got {policy_stage!r}")
    return f"export/{_iter(iteration)}"


def parse_export_stage(name: str) -> str | None:
    """The policy stage an export stage exports (inverse of :func:`export_stage`); None for any
    other name."""
    m = _EXPORT.match(name)
    if not m:
        return None
    return SFT if m.group(2) else ckpt_stage(int(m.group(1)))


def eval_label(policy_or_export_stage: str) -> str:
    """The label an evaluated stage gets in ``eval/{label}``: ``export/iter-0002`` → ``export-iter-0002``."""
    return policy_or_export_stage.replace("/", "-")


def eval_stage(label: str) -> str:
    return f"eval/{label}"


def template_pack_uri(store: ArtifactStore, run_id: str) -> str:
    """Manifest URI of the run's committed template_pack stage (its tokenizer and prompt tokens), for
    commands that start from a run id; the pipeline passes the URI template_pack returned."""
    if store.committed(run_id, TEMPLATE_PACK) is None:
        raise ArtifactNotFoundError(f"run {run_id!r} has no committed {TEMPLATE_PACK} stage")
    return store.manifest_uri(run_id, TEMPLATE_PACK)


def list_checkpoints(store: ArtifactStore, run_id: str) -> list[int]:
    """Iterations with a committed checkpoint, ascending."""
    found = (parse_ckpt_stage(m.stage) for m in store.list_manifests(run_id))
    return sorted(i for i in found if i is not None)


def list_exports(store: ArtifactStore, run_id: str) -> list[str]:
    """Committed export stages of the run, in the store's listing order."""
    return [m.stage for m in store.list_manifests(run_id) if parse_export_stage(m.stage) is not None]


def validations(store: ArtifactStore, run_id: str, lineage: str) -> dict[int, float]:
    """``{iteration: held-out accuracy}`` of the committed validations of policy ``lineage``."""
    out: dict[int, float] = {}
    for m in store.list_manifests(run_id):
        parsed = parse_iteration_stage(m.stage)
        if parsed is not None and parsed[1] == "val" and m.summary.get("iteration_lineage") == lineage:
            out[parsed[0]] = float(m.summary["accuracy"])
    return out


def iteration_summaries(store: ArtifactStore, run_id: str, kind: IterationKind) -> dict[int, dict[str, Any]]:
    """``{iteration: manifest summary}`` of the run's committed ``iter-XXXX/{kind}`` stages."""
    out: dict[int, dict[str, Any]] = {}
    for m in store.list_manifests(run_id):
        parsed = parse_iteration_stage(m.stage)
        if parsed is not None and parsed[1] == kind:
            out[parsed[0]] = dict(m.summary)
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------------------
# Rescores: rescore/{name}/{original stage}, rescore/{name}/report


def check_rescore_name(name: str) -> str:
    """``name`` if it can name a rescore (letters, digits, ``_ . = -``), else a one-line ConfigError."""
    if not _RESCORE_NAME.match(name) or name in (".", ".."):
        raise ConfigError(f"--name: got {name!r}, expected letters, digits, '_', '.', '=' or '-'")
    return name


def rescore_stage(name: str, stage: str) -> str:
    """``rescore_stage("strict", "iter-0003/reward") == "rescore/strict/iter-0003/reward"``."""
    return f"{RESCORE}/{check_rescore_name(name)}/{stage}"


def rescore_report_stage(name: str) -> str:
    """``rescore/{name}/report``: the comparison report of rescore ``name``."""
    return rescore_stage(name, REPORT)


def parse_rescore_stage(name: str) -> tuple[str, str] | None:
    """``"rescore/strict/iter-0003/reward"`` → ``("strict", "iter-0003/reward")``; None for any other name."""
    m = _RESCORE.match(name)
    return (m.group(1), m.group(2)) if m else None


RescoreSplit = Literal["train", "val", "eval"]


class RescoreTarget(NamedTuple):
    """A committed stage of a run that holds rollouts and their rewards, to score again.

    ``tables``: (rollouts file, rewards file) pairs; the rescore writes the same rewards file names."""

    stage: str  # iter-0003/reward, iter-0003/reward/gen-1, iter-0003/val or eval/{label}
    split: RescoreSplit
    iteration: int  # -1 for eval
    rollout_uri: str  # manifest holding the rollouts (for val and eval: the stage itself)
    rewards_uri: str  # manifest holding the original rewards
    tables: tuple[tuple[str, str], ...]


def rescore_targets(
    store: ArtifactStore, run_id: str, manifests: list[Manifest], span: tuple[int, int | None] | None
) -> list[RescoreTarget]:
    """The committed reward (and dynamic sampling's gen-K reward), val and eval stages of ``run_id``
    among ``manifests``, in iteration order (train before val, eval last). ``span``: iterations
    ``first <= i < stop`` (stop None: no end) of the reward and val stages; eval stages only when
    ``span`` is None."""
    found: list[tuple[tuple[int, int, int], RescoreTarget]] = []
    for m in manifests:
        names = {f.name for f in m.files}
        it, gen = parse_iteration_stage(m.stage), parse_generation_stage(m.stage)
        ev = _EVAL.match(m.stage)
        if it is not None and it[1] in ("reward", "val"):
            iteration, kind, g = it[0], it[1], -1
        elif gen is not None and gen[1] == "reward":
            iteration, kind, g = gen[0], "reward", gen[2]
        elif ev is not None and span is None:
            tables = tuple((f"{p}/rollouts.parquet", f"{p}/rewards.parquet") for p in ("greedy", "sampled"))
            tables = tuple(t for t in tables if set(t) <= names)
            uri = store.manifest_uri(run_id, m.stage)
            found.append(((1 << 62, 0, 0), RescoreTarget(m.stage, "eval", -1, uri, uri, tables)))
            continue
        else:
            continue
        if span is not None and not (span[0] <= iteration and (span[1] is None or iteration < span[1])):
            continue
        uri = store.manifest_uri(run_id, m.stage)
        if kind == "val":
            tables = (("rollouts.parquet", "rewards.parquet"),)
            if {"sampled/rollouts.parquet", "sampled/rewards.parquet"} <= names:
                tables += (("sampled/rollouts.parquet", "sampled/rewards.parquet"),)
            found.append(((iteration, 1, 0), RescoreTarget(m.stage, "val", iteration, uri, uri, tables)))
            continue
        rollout = (
            iteration_stage(iteration, "rollout") if g < 0 else generation_stage(iteration, "rollout", g)
        )
        if store.committed(run_id, rollout) is None:
            raise ArtifactNotFoundError(
                f"run {run_id!r}: {m.stage} is committed but its rollouts {rollout} are not"
            )
        target = RescoreTarget(
            m.stage, "train", iteration, store.manifest_uri(run_id, rollout), uri,
            (("rollouts.parquet", "rewards.parquet"),),
        )  # fmt: skip
        found.append(((iteration, 0, g), target))
    return [t for _, t in sorted(found, key=lambda x: (x[0], x[1].stage))]
