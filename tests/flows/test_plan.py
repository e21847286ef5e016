"""``verl-flow plan`` and the memory check of ``verl-flow run`` through the real CLI (typer's
CliRunner, in this process): a plan that fits exits 0 with its tables; one that cannot fit exits 1
with one line naming the knob; ``run`` refuses it before any work (no run directory, no Prefect);
``trainer.refuse_unfit=false`` turns the check off."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from verl_core.planning import capacity

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
GRPO = str(REPO / "configs" / "quickstart_grpo.yaml")
# Qwen2.5-0.5B's geometry and vocabulary from scratch: planned, never built
Q05 = [
    "model.hidden_size=896", "model.num_hidden_layers=24", "model.num_attention_heads=14",
    "model.num_key_value_heads=2", "model.intermediate_size=4864", "model.vocab_pad_to=151936",
    "actor.lr=1e-5",
]  # fmt: skip
runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_cost_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # the seconds table measures this CPU's matmul rate for a second: not what these tests check
    from verl_core.planning import cost

    monkeypatch.setattr(cost, "measure_cpu_matmul_rate", lambda: 1e10)


def test_plan_of_a_config_that_fits_prints_the_tables_and_exits_0() -> None:
    result = runner.invoke(app, ["plan", QUICKSTART, "--ram-gib", "8"])
    assert result.exit_code == 0, result.output
    for text in ("actor AdamW moments", "critic weights", "total vs capacity", "8.0 GiB", "iteration"):
        assert text in result.stdout


def test_plan_of_a_config_that_cannot_fit_exits_1_with_one_line_naming_the_knob() -> None:
    # 0.5B GRPO in fp32 needs ~9.9 GiB even with one-sample micro-batches (policy, moments and
    # reference 7.4 GiB, the HF engine's cache, the baseline); 8 GiB is too little, LoRA (moments of
    # the adapters only, no reference copy; 7.4 GiB at its SFT checkpoint) fits
    result = runner.invoke(app, ["plan", GRPO, *Q05, "--ram-gib", "8"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory: the run needs"), lines
    assert "over the 8.0 GiB" in lines[0] and "fix: model.lora_rank=16" in lines[0]


def test_plan_warns_when_only_full_lengths_do_not_fit() -> None:
    # the same run needs ~9.9 GiB with one-sample micro-batches, ~19 GiB with its 4,096-token budget
    # filled (10 GiB of activations): 11 GiB is a warning (exit 0), gradient checkpointing its fix
    result = runner.invoke(app, ["plan", GRPO, *Q05, "--ram-gib", "11"])
    assert result.exit_code == 0, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("warning: at full lengths memory:") and "fix: " in line


def test_run_refuses_a_config_that_cannot_fit_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a 0.5B PPO (policy + critic, ~11 GiB of weights and moments) on a machine with 4 GiB free
    monkeypatch.setattr(capacity, "host_ram_available", lambda: 4 * capacity.GIB)
    result = runner.invoke(app, ["run", QUICKSTART, *Q05, f"store.url={tmp_path}"])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: memory: the run needs") and "RAM" in line
    assert list(tmp_path.iterdir()) == []  # nothing written: refused before any work


def test_refuse_unfit_false_turns_the_check_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from flows.cli.plan import check_fits
    from verl_core.config import load_config

    monkeypatch.setattr(capacity, "host_ram_available", lambda: 4 * capacity.GIB)
    assert check_fits(load_config(QUICKSTART, Q05)) is not None
    assert check_fits(load_config(QUICKSTART, [*Q05, "trainer.refuse_unfit=false"])) is None
    # the quickstart itself fits the same small machine
    assert check_fits(load_config(QUICKSTART)) is None


def test_the_checkpoint_page_cache_comes_from_what_the_plan_leaves_free() -> None:
    from flows.cli.plan import free_at_checkpoint
    from verl_core.config import load_config
    from verl_core.planning.memory import plan_memory

    plan = plan_memory(load_config(QUICKSTART))
    held = plan.pool_at("cpu", "checkpoint")  # tests/verl_core/planning/test_memory.py checks the sum
    assert held > 0  # the trainer's weights, moments and the checkpoint's files at least
    gib8 = 8 << 30
    assert free_at_checkpoint(plan, capacity.Capacity({"cpu": gib8}, {})) == gib8 - held
    assert free_at_checkpoint(plan, capacity.Capacity({"cpu": held // 2}, {})) == 0  # not below 0
    assert free_at_checkpoint(plan, capacity.Capacity({}, {})) is None  # RAM unknown: all fresh
