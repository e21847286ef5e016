"""Where a run's sample sets are: the committed stages holding rollouts and their rewards, found
through their manifests only (:mod:`stages.floor.locations` names them).

    train   key iter-0003            iter-0003/rollout, iter-0003/reward, iter-0003/update (when
                                     committed: the checkpoint after it publishes it)
            key iter-0003/gen-1      dynamic sampling's generation batch 1 (its rows train through
                                     the iteration's update, which is not joined here)
    val     key iter-0003            iter-0003/val greedy; iter-0003/sampled its sampled pass
    eval    key {label}/greedy       eval/{label}; {label}/sampled its sampled pass

A set's prompts (the chat messages without the template) are the ``prompt_tokens`` file of the
template_pack stage its rollout or held-out stage names as input ``prompts``.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from stages.floor.locations import (
    generation_stage,
    iteration_stage,
    parse_generation_stage,
    parse_iteration_stage,
)
from verl_core.store import ArtifactStore, Manifest

SampleKind = Literal["train", "val", "eval"]
SAMPLE_KINDS: tuple[SampleKind, ...] = ("train", "val", "eval")
_PROMPTS_FILE = {"train": "prompt_tokens/train.parquet", "val": "prompt_tokens/val.parquet"}


class SampleSet(NamedTuple):
    """One set's files (paths DuckDB reads: local paths or ``s3://`` URLs); ``update`` None when
    the set has no committed update, ``prompts`` None when its template_pack stage is not found."""

    kind: SampleKind
    key: str
    iteration: int  # -1 for eval
    stage: str
    rows: int
    rollouts: str
    rewards: str
    update: str | None
    prompts: str | None
    template_pack_uri: str | None


def list_sets(store: ArtifactStore, run_id: str, manifests: list[Manifest]) -> list[SampleSet]:
    """Every committed sample set of ``run_id`` among its ``manifests``: train by iteration, then
    val, then eval."""
    by_stage = {m.stage: m for m in manifests}
    found: list[SampleSet] = []
    for m in manifests:
        it, gen = parse_iteration_stage(m.stage), parse_generation_stage(m.stage)
        if it is not None and it[1] == "reward":
            found += _train(store, by_stage, m, it[0], None)
        elif gen is not None and gen[1] == "reward":
            found += _train(store, by_stage, m, gen[0], gen[2])
        elif it is not None and it[1] == "val":
            tp = _prompts_input(store, m)
            key = f"iter-{it[0]:04d}"
            for sub, name in (("", key), ("sampled/", f"{key}/sampled")):
                if _has(m, f"{sub}rollouts.parquet", f"{sub}rewards.parquet"):
                    found.append(_set(store, "val", name, it[0], m, m, sub, None, tp))
        elif m.stage.startswith("eval/"):
            tp = _prompts_input(store, m)
            label = m.stage.removeprefix("eval/")
            for sub in ("greedy", "sampled"):
                if _has(m, f"{sub}/rollouts.parquet", f"{sub}/rewards.parquet"):
                    found.append(_set(store, "eval", f"{label}/{sub}", -1, m, m, f"{sub}/", None, tp))
    order = {k: i for i, k in enumerate(SAMPLE_KINDS)}
    return sorted(found, key=lambda s: (order[s.kind], s.iteration if s.kind == "train" else 0, s.key))


def _train(
    store: ArtifactStore, by_stage: dict[str, Manifest], reward: Manifest, iteration: int, gen: int | None
) -> list[SampleSet]:
    if gen is None:
        rollout = by_stage.get(iteration_stage(iteration, "rollout"))
        update = by_stage.get(iteration_stage(iteration, "update"))
        key = f"iter-{iteration:04d}"
    else:
        rollout, update = by_stage.get(generation_stage(iteration, "rollout", gen)), None
        key = f"iter-{iteration:04d}/gen-{gen}"
    if rollout is None or not _has(reward, "rewards.parquet"):
        return []
    tp = _prompts_input(store, rollout)
    return [_set(store, "train", key, iteration, rollout, reward, "", update, tp)]


def _set(
    store: ArtifactStore,
    kind: SampleKind,
    key: str,
    iteration: int,
    rollouts: Manifest,
    rewards: Manifest,
    sub: str,
    update: Manifest | None,
    template_pack_uri: str | None,
) -> SampleSet:
    prompts = None
    if template_pack_uri is not None:
        tp = store.read_manifest(template_pack_uri)
        name = _PROMPTS_FILE["train" if kind == "train" else "val"]
        prompts = file_path(store, tp, name) if _has(tp, name) else None
    return SampleSet(
        kind,
        key,
        iteration,
        rollouts.stage,
        int(rollouts.file(f"{sub}rollouts.parquet").rows or 0),
        file_path(store, rollouts, f"{sub}rollouts.parquet"),
        file_path(store, rewards, f"{sub}rewards.parquet"),
        file_path(store, update, "update.parquet") if update and _has(update, "update.parquet") else None,
        prompts,
        template_pack_uri,
    )


def file_path(store: ArtifactStore, manifest: Manifest, name: str) -> str:
    """What DuckDB reads for a committed file: a local path, or the object store URL."""
    uri = store.file_uri(manifest, name)
    return uri.removeprefix("file://") if uri.startswith("file://") else uri


def _has(m: Manifest, *names: str) -> bool:
    have = {f.name for f in m.files}
    return all(n in have for n in names)


def _prompts_input(store: ArtifactStore, m: Manifest) -> str | None:
    found = m.inputs.get("prompts")
    return in_store(store, found["uri"]) if found else None


def in_store(store: ArtifactStore, uri: str) -> str:
    """``uri`` of a manifest as this store names it: a store copied elsewhere (a local run synced to
    a bucket) keeps its manifests' input URIs, which point to ``.../runs/{run}/...`` of the old place."""
    if uri.startswith(store.url + "/") or "/runs/" not in uri:
        return uri
    return store.uri(store.path(uri[uri.rindex("/runs/") + 1 :]))
