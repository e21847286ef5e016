"""How the RL task shells find the run's session (stages/floor/session.py): only inside a binding of
that run (a slot the loop bound and the init task filled, or an open session bound whole), in copied
contexts too (Prefect's task runners, the ahead rollout's thread), never in a plain thread; closing
the session closes its engine, frees its scorers and gives glibc's heap its defaults back."""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from stages.floor.session import RLSession, bound, session_of, slot_of
from verl_core.config import RewardConfig, SandboxConfig
from verl_core.runtime.run import RunContext


class StubEngine:
    """A rollout engine stand-in: the session's bookkeeping needs none; closing it is recorded."""

    closed = False

    def close(self) -> None:
        self.closed = True


def stub_session(run_id: str) -> RLSession:
    """A session with no models (the binding and the scorer cache read none of them)."""
    none: Any = None
    return RLSession(
        run_id=run_id, lm=none, actor=none, actor_engine=none, ref=None, critic=None, critic_engine=None,
        tokenizer=None, engine=StubEngine(), kl_ctrl=none, version=0, iterations=1, lineage="l", device=none,
    )  # fmt: skip


def _ctx(run_id: str) -> RunContext:
    return RunContext(run_id=run_id, store_url="/nonexistent")


def test_a_task_shell_finds_only_its_own_runs_open_session() -> None:
    with pytest.raises(RuntimeError, match=r"no RL session is bound for run 'a' \(bound: none\)"):
        session_of(_ctx("a"))
    with bound("a") as slot:  # the loop's slot, before init_rl_state opened the session
        with pytest.raises(RuntimeError, match="the RL session of run 'a' is not open"):
            session_of(_ctx("a"))
        session = slot.fill(stub_session("a"))
        assert session_of(_ctx("a")) is session
        with pytest.raises(RuntimeError, match=r"no RL session is bound for run 'b' \(bound: 'a'\)"):
            session_of(_ctx("b"))
        with pytest.raises(RuntimeError, match="run 'b' in run 'a'"):
            slot.fill(stub_session("b"))
        with bound(stub_session("b")) as inner:  # nested: the inner binding, then the outer again
            assert session_of(_ctx("b")) is inner.session
        assert session_of(_ctx("a")) is session
    with pytest.raises(RuntimeError, match="no RL session is bound"):
        slot_of(_ctx("a"))  # the binding ended with the block


def test_a_copied_context_carries_the_binding_into_a_thread_a_plain_thread_does_not() -> None:
    def lookup() -> RLSession | str:
        try:
            return session_of(_ctx("a"))
        except RuntimeError:
            return "unbound"

    with bound(stub_session("a")) as slot, ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(contextvars.copy_context().run, lookup).result() is slot.session
        assert pool.submit(lookup).result() == "unbound"


def test_closing_closes_the_engine_and_frees_the_scorers_and_restores_the_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    restored: list[bool] = []
    monkeypatch.setattr("stages.floor.session.restore_heap", lambda: restored.append(True))
    session = stub_session("a")
    session.scorers(RewardConfig(), SandboxConfig())
    with bound("a") as slot:
        slot.fill(session)
        slot.close()
        assert slot.session is None
    assert session.built_scorers == {} and session.engine.closed  # type: ignore[attr-defined]
    assert restored == [True]  # glibc's defaults back (opening the session retained the freed heap)
