"""The config hash of a run of its own is exactly as before the ``parent`` section existed (its default
run id stays the same); its run record and tracker tags: tests/flows/test_runs.py."""

from __future__ import annotations

from pathlib import Path

from verl_core.config import load_config, with_overrides

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
