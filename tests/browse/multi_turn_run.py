"""Makes the rollout browser's multi-turn fixture run (``python -m tests.browse.multi_turn_run STORE``):
the reliability suite's tiny pipeline (scratch 2-layer Qwen2, arithmetic prompts) without SFT, GRPO
with ``rollout.multi_turn`` on, one iteration of 2 prompts × 4 samples, MLflow tracking on (the
SQLite database in the store: the runs page shows the run id and the ``mlflow ui`` command).

The random policy never writes a tool call, so the ``hermes`` call format is swapped for one that
reads a calculator call ``6*7`` in every model turn that stopped (stop strings: any digit or space),
as tests/flows/test_rl_multi_turn.py does: responses hold model turns, tool turns (``42``, masked out
of the loss) and model turns again; a model turn cut by its token budget has no call."""

from __future__ import annotations

import sys

RUN = "tools"
GROUP_SIZE = 4  # rollout.n
ARGS = [
    "run", "tests/reliability/tiny.yaml", "sft.enable=false", "algorithm.adv_estimator=grpo",
    f"rollout.n={GROUP_SIZE}", "data.train_batch_size=2", "data.max_response_length=48",
    "trainer.total_iterations=1", "trainer.save_freq=0", "eval.enable=false", "export.enable=false",
    "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=3",
    "rollout.multi_turn.max_tokens_per_turn=8", "rollout.stop=[' ','0','1','2','3','4','5','6','7','8','9']",
    "reward.scorers=[function]", "reward.function=tests/flows/rl_rewards.py:half_credit",
    "tracking.enabled=true", "--run-id", RUN,
]  # fmt: skip


def main(store: str) -> None:
    from flows.cli import app
    from verl_core.tools.parsing import TOOL_CALL_FORMATS, ToolCall, ToolCallFormat

    def always_calls(text: str) -> list[ToolCall]:
        return [ToolCall("calculator", {"expression": "6*7"}, "", None)]

    TOOL_CALL_FORMATS._entries["hermes"] = ToolCallFormat(always_calls, "</tool_call>")
    app([*ARGS, f"store.url={store}"], standalone_mode=False)


if __name__ == "__main__":
    main(sys.argv[1])
