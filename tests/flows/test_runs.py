"""Starting a run from its config (:mod:`flows.runs`): the run record and tracker tags of a fork or
replay; a run of its own is recorded exactly as before the ``parent`` section existed."""

from __future__ import annotations

import json
from pathlib import Path

from flows.runs import family_tags, start_run
from verl_core.config import load_config, with_overrides
from verl_core.runtime.run import end_run

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


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
