"""The run record and tracker tags of a fork or replay (verl_core.runtime.run); a run of its own is recorded
exactly as before the ``parent`` section existed."""

from __future__ import annotations

import json
from pathlib import Path

from verl_core.config import load_config, with_overrides
from verl_core.runtime.run import end_run, family_tags, start_run

QUICKSTART = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"


def test_config_hash_of_a_run_without_parent_is_unchanged() -> None:
    # an unset parent section adds nothing to the hash: the quickstart's hash is the one of its keys
    # without a parent (pinned when issue 40 added the gate and retrain sections, commits c64ea7e and
    # 31016fd, and issue 39 renamed the stage deployments' defaults, commit f5b3965; 4dd70e5f... when
    # issue 38 added reward.function_kwargs, commit 9823b57; 88b02b8f... from issue 37's
    # model.vocab_pad_to and trainer.refuse_unfit, commits 1e6afe9 and c1c5808; ace9d800... from
    # 6c60675 on, when issue 29 removed data.pack_token_budget, data.pack_algorithm and
    # rollout.decode; ec9f7cc3... from 882181a on)
    cfg = load_config(QUICKSTART)
    assert cfg.config_hash() == "0813274a06abe5946f85abf64acafdfb7b1acece80315f1fc0cea147a565be1f"
    fork = with_overrides(cfg, ["parent.run_id=quickstart-88b02b8f", "parent.iteration=10"])
    assert fork.config_hash() != cfg.config_hash()


def test_family_tags() -> None:
    cfg = load_config(QUICKSTART)
    assert family_tags(cfg) == {}
    fork = with_overrides(cfg, ["parent.run_id=p", "parent.iteration=10"])
    assert family_tags(fork) == {
        "verl_flow.parent_run_id": "p", "verl_flow.parent_iteration": "10", "verl_flow.kind": "fork",
    }  # fmt: skip
    replay = with_overrides(fork, ["parent.replay=true", "parent.rewards=strict"])
    assert family_tags(replay)["verl_flow.kind"] == "replay"
    assert family_tags(replay)["verl_flow.replay_rewards"] == "strict"


def test_run_json_records_the_parent_only_when_set(tmp_path: Path) -> None:
    base = load_config(QUICKSTART, [f"store.url={tmp_path}", "tracking.enabled=false"])
    for run_id, cfg in (
        ("own", base),
        ("child", with_overrides(base, ["parent.run_id=own", "parent.iteration=2"])),
    ):
        end_run(start_run(cfg, run_id))
    own = json.loads((tmp_path / "runs" / "own" / "run.json").read_text())["config"]
    child = json.loads((tmp_path / "runs" / "child" / "run.json").read_text())["config"]
    assert "parent" not in own
    assert child["parent"] == {"run_id": "own", "iteration": 2, "replay": False, "rewards": None}
