"""The pure parts of forks and replays (:mod:`stages.floor.parent`): ``RUN@ITER`` parsing, the replay's
override rules, the parent's checkpoint and stored data looked up in a hand-made store (one-line
refusals naming what is there), the replay's config, and the family tree of run records. No pipeline
runs here (the end-to-end tests are tests/reliability/test_replay_fork.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stages.floor.locations import ckpt_stage, iteration_stage, rescore_stage
from stages.floor.parent import (
    FORK_START,
    RunLink,
    check_parent,
    check_replay_overrides,
    family_tree,
    fork_start,
    parse_parent_spec,
    read_family,
    replay_config,
    replay_sources,
    run_link,
)
from verl_core.config import ParentConfig, VerlFlowConfig, load_config, with_overrides
from verl_core.errors import ArtifactNotFoundError, ConfigError
from verl_core.store import ArtifactStore

TINY = str(Path(__file__).resolve().parents[1] / "reliability" / "tiny.yaml")


def test_parse_parent_spec() -> None:
    assert parse_parent_spec("left@10") == ("left", 10)
    assert parse_parent_spec(" run-a.b@2 ") == ("run-a.b", 2)
    for bad in ("left", "left@", "@3", "left@x", "left@0", "left@-1", "a b@1", "a@b@3"):
        with pytest.raises(ConfigError, match=r"--fork: got .* expected RUN_ID@ITERATION"):
            parse_parent_spec(bad)


@pytest.mark.parametrize(
    "ok", ["algorithm.adv_estimator=rloo", "actor.clip_ratio=0.1", "critic.lr=1e-4", "trainer.save_freq=1",
           "eval.enable=false", "algorithm.rollout_correction.rollout_is=token"],
)  # fmt: skip
def test_replay_overrides_allowed(ok: str) -> None:
    check_replay_overrides([ok])  # no error


@pytest.mark.parametrize(
    "bad, field",
    [
        ("rollout.n=4", "rollout.n"),
        ("rollout.temperature=0.7", "rollout.temperature"),
        ("data.train_batch_size=8", "data.train_batch_size"),
        ("model.hidden_size=64", "model.hidden_size"),
        ("trainer.seed=3", "trainer.seed"),
        ("trainer.total_iterations=40", "trainer.total_iterations"),
        ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable"),
    ],
)
def test_replay_refuses_overrides_that_change_the_data_naming_the_field(bad: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_replay_overrides(["actor.lr=1e-5", bad])
    msg = str(e.value)
    assert msg.startswith(f"'{field}': a replay trains on the parent's stored rollouts") and "\n" not in msg


def test_replay_refuses_reward_overrides_pointing_to_rescore() -> None:
    with pytest.raises(ConfigError, match=r"'reward.gsm8k_method'.*rescore the run .* --rewards NAME"):
        check_replay_overrides(["reward.gsm8k_method=flexible"])


def _commit(store: ArtifactStore, run: str, stage: str) -> None:
    w = store.open_stage(run, stage)
    w.write_bytes("x.bin", stage.encode())
    w.commit()


@pytest.fixture
def store(tmp_path: Path) -> ArtifactStore:
    """Run P (tiny config, SFT on, 3 iterations): checkpoints 2 and 3 only (1 pruned), rollouts and
    rewards of iterations 0-2, a rescore "strict" of iteration 1 only. Run F: a fork of P at 2. Run R: a
    replay of F at 2 (a chain P → F → R)."""
    st = ArtifactStore(str(tmp_path))
    cfg = load_config(TINY, ["trainer.total_iterations=3"])
    st.write_run_record("P", cfg.model_dump(mode="json"), cfg.config_hash())
    for stage in ["sft", ckpt_stage(2), ckpt_stage(3)]:
        _commit(st, "P", stage)
    for it in range(3):
        _commit(st, "P", iteration_stage(it, "rollout"))
        _commit(st, "P", iteration_stage(it, "reward"))
    _commit(st, "P", rescore_stage("strict", iteration_stage(1, "reward")))
    fork = with_overrides(cfg, ["parent.run_id=P", "parent.iteration=2", "trainer.total_iterations=4"])
    st.write_run_record("F", fork.model_dump(mode="json"), fork.config_hash())
    _commit(st, "F", ckpt_stage(3))
    replay = with_overrides(fork, ["parent.run_id=F", "parent.iteration=3", "parent.replay=true"])
    st.write_run_record("R", replay.model_dump(mode="json"), replay.config_hash())
    return st


def test_fork_start_refuses_a_pruned_checkpoint_and_a_missing_run_in_one_line(store: ArtifactStore) -> None:
    with pytest.raises(ArtifactNotFoundError) as e:
        fork_start(store, ParentConfig(run_id="P", iteration=1))
    assert str(e.value) == (
        "parent.iteration: run 'P' has no checkpoint at iteration 1 (available: 2, 3; older ones are "
        "pruned by trainer.max_ckpt_to_keep)"
    )
    with pytest.raises(
        ArtifactNotFoundError, match=r"^parent.run_id: no run 'nope' in .* \(runs: F, P, R\)$"
    ):
        fork_start(store, ParentConfig(run_id="nope", iteration=2))


def test_fork_start_reference_is_the_root_runs_sft(store: ArtifactStore) -> None:
    # R → F → P: the reference of a fork of a fork is P's SFT policy, the family's start
    start = fork_start(store, ParentConfig(run_id="F", iteration=3))
    assert start.checkpoint.run_id == "F" and start.checkpoint.stage == "ckpt/iter-0003"
    assert start.reference_sft is not None and (start.reference_sft.run_id, start.reference_sft.stage) == (
        "P",
        "sft",
    )
    # the lineage start is the checkpoint manifest's hash; a replay's differs (it reads the parent's data)
    sha = store.manifest_sha256(store.manifest_uri("F", "ckpt/iter-0003"))
    assert start.identity == sha
    replay = fork_start(store, ParentConfig(run_id="F", iteration=3, replay=True, rewards="strict"))
    assert replay.identity == f"{sha}+replay:strict"


def test_replay_sources_own_and_rescored_rewards(store: ArtifactStore) -> None:
    own = replay_sources(store, ParentConfig(run_id="P", iteration=2, replay=True), 1)
    assert own == (
        store.manifest_uri("P", "iter-0001/rollout"),
        store.manifest_uri("P", "iter-0001/reward"),
    )
    strict = ParentConfig(run_id="P", iteration=2, replay=True, rewards="strict")
    assert replay_sources(store, strict, 1)[1] == store.manifest_uri("P", "rescore/strict/iter-0001/reward")
    with pytest.raises(ArtifactNotFoundError) as e:
        replay_sources(store, strict, 2)  # the rescore covered iteration 1 only
    assert str(e.value) == (
        "replay: run 'P' has no committed rescore/strict/iter-0002/reward for iteration 2 "
        "(the rescore did not cover it)"
    )


def test_check_parent_needs_every_replayed_iteration(store: ArtifactStore) -> None:
    # P has rollouts of iterations 0-2; a replay from 2 with 3 iterations needs iteration 2 only: fine
    cfg = replay_config(store, "P", 2, [], None)
    check_parent(store, cfg)
    # 4 iterations would need iteration 3, which P never sampled (trainer.total_iterations is not
    # replayable, so build that config by hand)
    longer = with_overrides(cfg, ["trainer.total_iterations=4"])
    with pytest.raises(ArtifactNotFoundError, match=r"^replay: run 'P' has no committed iter-0003/rollout"):
        check_parent(store, longer)


def test_replay_config_is_the_parents_with_overrides(store: ArtifactStore) -> None:
    parent = load_config(TINY, ["trainer.total_iterations=3"])
    cfg = replay_config(store, "P", 2, ["algorithm.adv_estimator=rloo"], "strict")
    assert cfg.parent == ParentConfig(run_id="P", iteration=2, replay=True, rewards="strict")
    assert cfg.algorithm.adv_estimator == "rloo" and parent.algorithm.adv_estimator == "gae"
    assert cfg.store.url == store.url
    same = {k: v for k, v in parent.model_dump().items() if k not in ("algorithm", "store", "parent")}
    assert {k: v for k, v in cfg.model_dump().items() if k in same} == same
    with pytest.raises(ConfigError, match=r"^algorithm.adv_estimator: remax and the parent's gae differ"):
        replay_config(store, "P", 2, ["algorithm.adv_estimator=remax"], None)


def test_parent_section_preflight() -> None:
    base = VerlFlowConfig()  # 20 iterations
    with pytest.raises(ConfigError, match=r"parent.iteration: 20 leaves nothing to train"):
        with_overrides(base, ["parent.run_id=a", "parent.iteration=20"])
    with pytest.raises(ConfigError, match=r"parent.rewards: a rescore's rewards are read by a replay only"):
        with_overrides(base, ["parent.run_id=a", "parent.iteration=2", "parent.rewards=x"])


def test_run_link_from_recorded_configs() -> None:
    assert run_link("a", {"trainer": {}}) == RunLink("a", None, None, "run", None)
    assert run_link("a", {"parent": None}) == RunLink("a", None, None, "run", None)
    p = {"run_id": "p", "iteration": 3, "replay": True, "rewards": "strict"}
    assert run_link("a", {"parent": p}) == RunLink("a", "p", 3, "replay", "strict")


def test_family_tree_up_and_down() -> None:
    #   root ─┬─ f1 (fork @2) ─── r1 (replay of f1 @4)
    #         └─ r0 (replay @1)
    #   lone (no parent), orphan (parent "gone" not in the store)
    links = {
        "root": RunLink("root", None, None, "run", None),
        "f1": RunLink("f1", "root", 2, "fork", None),
        "r0": RunLink("r0", "root", 1, "replay", "strict"),
        "r1": RunLink("r1", "f1", 4, "replay", None),
        "lone": RunLink("lone", None, None, "run", None),
        "orphan": RunLink("orphan", "gone", 5, "fork", None),
    }
    t = family_tree(links, "f1")
    assert [a.run_id for a in t.ancestors] == ["root"]
    assert [(d, c.run_id) for d, c in t.descendants] == [(1, "r1")]
    t = family_tree(links, "root")
    assert t.ancestors == []
    # children by parent iteration: r0 (@1) before f1 (@2), each followed by its own children
    assert [(d, c.run_id) for d, c in t.descendants] == [(1, "r0"), (1, "f1"), (2, "r1")]
    t = family_tree(links, "r1")
    assert [a.run_id for a in t.ancestors] == ["f1", "root"] and t.descendants == []
    assert family_tree(links, "lone") == (links["lone"], [], [])
    t = family_tree(links, "orphan")
    assert [(a.run_id, a.kind) for a in t.ancestors] == [("gone", "missing")]


def test_read_family_from_run_records(store: ArtifactStore) -> None:
    links = read_family(store)
    assert links["P"].kind == "run" and links["F"] == RunLink("F", "P", 2, "fork", None)
    assert links["R"] == RunLink("R", "F", 3, "replay", None)
    t = family_tree(links, "F")
    assert [a.run_id for a in t.ancestors] == ["P"] and [c.run_id for _, c in t.descendants] == ["R"]


def test_a_fork_resumes_from_its_own_checkpoint_after_the_parents_is_pruned(store: ArtifactStore) -> None:
    # F forked P at 2 and committed ckpt/iter-0003 recording where it started; then P pruned its ckpt 2
    start = fork_start(store, ParentConfig(run_id="P", iteration=2))
    assert start.checkpoint is not None
    w = store.open_stage("F", ckpt_stage(4))
    w.write_bytes("x.bin", b"4")
    w.commit(summary={"iteration": 4, FORK_START: start.identity})
    store.delete_stage("P", ckpt_stage(2))
    fork_cfg = with_overrides(
        load_config(TINY), ["parent.run_id=P", "parent.iteration=2", "trainer.total_iterations=5"]
    )
    resumed = fork_start(store, ParentConfig(run_id="P", iteration=2), store.committed("F", ckpt_stage(4)))
    assert resumed.checkpoint is None and resumed.identity == start.identity
    assert resumed.reference_sft is not None and resumed.reference_sft.run_id == "P"  # still the family's
    check_parent(store, fork_cfg, "F")  # F resumes from its own checkpoint 4: fine
    with pytest.raises(ArtifactNotFoundError, match=r"no checkpoint at iteration 2 \(available: 3;"):
        check_parent(store, fork_cfg, "another")  # a new fork of P@2 cannot start any more
