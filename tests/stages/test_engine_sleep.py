"""The RL loop puts a rollout engine with its own weights to sleep for the update and wakes it before
the new weights load: sleep → (update) → wake_up → reload → generate where the platform has sleep
mode (vLLM on a GPU), nothing of the two elsewhere. The engine is :class:`VLLMEngineBase`'s lifecycle
with its four vLLM hooks recorded."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from stages import ppo_update as ppo_update_module
from stages.floor import session as session_module
from stages.floor.session import engine_held, rest_engine, session_of
from stages.ppo_update import ppo_update
from stages.reward import reward
from stages.rollout import rollout
from tests.stages.conftest import TINY_RL, opened
from tests.verl_core.rollout.conftest import vllm_spec
from verl_core.config import SandboxConfig
from verl_core.rollout import Completion, SamplingParams
from verl_core.rollout.vllm_base import VLLMEngineBase
from verl_core.runtime.run import RunContext


class RecordingEngine(VLLMEngineBase):
    """A vLLM engine whose calls into vLLM are recorded in ``calls`` (no vLLM behind them)."""

    def __init__(self, can_sleep: bool, calls: list[str]) -> None:
        super().__init__(vllm_spec(), None, tempfile.mkdtemp(), policy_version=0)
        self.can_sleep, self.calls = can_sleep, calls

    def load_staged_weights(self, directory: str, version: int) -> None:
        self.calls.append("reload")
        self._version = version

    def load_adapter_dir(self, path: str, version: int) -> None:
        self.calls.append("adapter")
        self._version = version

    def _generate_ids(
        self, prompt_ids: list[list[int]], params: SamplingParams, prompt_keys: Sequence[int] | None
    ) -> list[Completion]:
        self.calls.append("generate")
        return []

    def _set_asleep(self, asleep: bool) -> None:
        self.calls.append("sleep" if asleep else "wake_up")

    def close(self) -> None:
        pass


@pytest.fixture
def ctx(tiny_rl: tuple[Path, str], request: pytest.FixtureRequest) -> Iterator[RunContext]:
    run = RunContext(run_id=request.node.name.replace("[", "-").rstrip("]"), store_url=str(tiny_rl[0]))
    with opened(run, TINY_RL, tiny_rl[1], None):
        yield run


@pytest.mark.parametrize("can_sleep", [True, False], ids=["sleep-mode", "no-sleep-mode"])
def test_the_update_runs_while_the_engine_sleeps_and_the_sync_wakes_it_first(
    can_sleep: bool, ctx: RunContext, tiny_rl: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lineage = session_of(ctx).lineage
    r = rollout.fn(ctx, TINY_RL.data, TINY_RL.rollout, tiny_rl[1], 0, lineage)  # (the HF engine)
    w = reward.fn(ctx, TINY_RL.reward, r, 0, TINY_RL.data.max_response_length, sandbox=SandboxConfig())
    calls: list[str] = []
    state = session_of(ctx)
    state.engine = RecordingEngine(can_sleep, calls)
    iteration = ppo_update_module.ppo_iteration

    def recorded_iteration(*args: Any, **kwargs: Any) -> Any:
        calls.append("update")
        return iteration(*args, **kwargs)

    monkeypatch.setattr(ppo_update_module, "ppo_iteration", recorded_iteration)
    monkeypatch.setattr(session_module, "release_cached_memory", lambda: calls.append("release"))
    monkeypatch.setattr(session_module, "barrier", lambda: calls.append("barrier"))
    ppo_update.fn(ctx, TINY_RL, r, w, 0)
    state.engine.generate([[1, 2]], SamplingParams(max_new_tokens=1))  # the next rollout
    # with sleep mode the engine frees the device for the update and wakes before the reload (its
    # pages are unmapped while asleep), once the trainer has handed its cached blocks back and every
    # rank has (the barrier); without sleep mode, neither sleep nor wake_up is called
    synced = ["release", "barrier"]
    expected = ["sleep", "update", *synced, "wake_up", "reload", "generate"]
    assert calls == (expected if can_sleep else ["update", *synced, "reload", "generate"])
    assert state.engine.policy_version == 1
    calls.clear()
    with engine_held(state):  # an ahead rollout samples the engine during the update: no sleep
        rest_engine(state)
    assert calls == []
