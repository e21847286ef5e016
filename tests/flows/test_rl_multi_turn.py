"""The RL loop with ``rollout.multi_turn.enable`` on a tiny model: tool turns reach the rollouts table
(turns, loss mask) and the update trains on the model's tokens only.

The random policy never writes a tool call, so the test swaps the ``hermes`` call format for one
that reads a calculator call in every model turn that stopped (stop strings: any digit or space):
the loop, the tables and the update then see real tool turns between model turns."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.rl import rl_loop
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from verl_core.runtime.run import RunContext
from verl_core.tools.parsing import TOOL_CALL_FORMATS, ToolCall, ToolCallFormat

from .test_rl_resume import CFG


def always_calls(text: str) -> list[ToolCall]:
    return [ToolCall("calculator", {"expression": "6*7"}, "", None)]


def test_rl_loop_with_tool_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TOOL_CALL_FORMATS._entries, "hermes", ToolCallFormat(always_calls, "</tool_call>"))
    multi_turn = {"enable": True, "max_turns": 2, "max_tokens_per_turn": 8}
    cfg = CFG.model_copy(
        update={
            "data": CFG.data.model_copy(update={"max_response_length": 64}),
            "rollout": CFG.rollout.model_copy(
                update={
                    "multi_turn": CFG.rollout.multi_turn.model_copy(update=multi_turn),
                    "stop": [*"0123456789 "],
                }
            ),
            "trainer": CFG.trainer.model_copy(update={"total_iterations": 1, "save_freq": 0}),
        }
    )
    ctx = RunContext(run_id="mt", store_url=str(tmp_path))
    tp = template_pack.fn(ctx, cfg.data, cfg.model, preprocess.fn(ctx, cfg.data))
    rl_loop(ctx, cfg, tp, None)
    store = ctx.store()
    rollouts = store.read_table(store.committed("mt", "iter-0000/rollout"), "rollouts.parquet").to_pylist()
    assert store.committed("mt", "iter-0000/update") is not None
    assert len(rollouts) == 4  # 2 prompts × n=2
    for row in rollouts:
        turns, mask = row["turns"], row["loss_mask"]
        roles = [t["role"] for t in turns]
        assert roles[0] == "assistant" and roles[-1] == "assistant"
        assert [i for t in turns for i in t["ids"]] == row["response_ids"]
        assert mask == [int(t["role"] == "assistant") for t in turns for _ in t["ids"]]
        assert row["response_length"] == sum(mask)
        for t in turns:
            if t["role"] == "tool":
                assert "42" in t["text"] and t["calls"][0]["result"] == "42"
    assert any("tool" in [t["role"] for t in r["turns"]] for r in rollouts)
    # GRPO advantages live on the model's tokens only (the update's table is row-aligned)
    update = store.read_table(store.committed("mt", "iter-0000/update"), "update.parquet").to_pylist()
    for row, u in zip(rollouts, update, strict=True):
        assert all(a == 0.0 for a, m in zip(u["advantages"], row["loss_mask"], strict=True) if m == 0)
