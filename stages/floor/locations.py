"""Stage locations: the names of a run's stages, built and parsed here and nowhere else.

    preprocess, template_pack, sft, sft-ckpt, report       one per run
    iter-XXXX/{rollout,reward,update,val}                  per RL iteration (XXXX: 4+ digits)
    iter-XXXX/{rollout,reward}/gen-K                       generation batch K of an iteration (dynamic
                                                           sampling, algorithm.filter_groups)
    ckpt/iter-XXXX                                         RL checkpoint after XXXX updates
    export/iter-XXXX, export/sft                           merged HF export of a policy
    eval/{label}                                           evaluation of a policy

Every ``parse_*`` function returns None for a name that is not of its kind.
"""

from __future__ import annotations

import re
from typing import Any, Literal, cast, get_args

from verl_core.errors import ArtifactNotFoundError
from verl_core.store import ArtifactStore

IterationKind = Literal["rollout", "reward", "update", "val"]
ITERATION_KINDS: tuple[IterationKind, ...] = get_args(IterationKind)
GenerationKind = Literal["rollout", "reward"]
GENERATION_KINDS: tuple[GenerationKind, ...] = get_args(GenerationKind)

PREPROCESS = "preprocess"
TEMPLATE_PACK = "template_pack"
SFT = "sft"
SFT_CKPT = "sft-ckpt"
REPORT = "report"

_ITERATION = re.compile(r"^iter-(\d{4,})/(rollout|reward|update|val)$")
_GENERATION = re.compile(r"^iter-(\d{4,})/(rollout|reward)/gen-(\d+)$")
_CKPT = re.compile(r"^ckpt/iter-(\d{4,})$")
_EXPORT = re.compile(r"^export/(?:iter-(\d{4,})|(sft))$")


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
