"""The SPMD launcher: its failure report, when a config runs as an SPMD job, the entry point of a job."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from launcher.spmd import (
    PREFECT_CONTEXT_ENV,
    SpmdJob,
    SpmdJobError,
    failure_summary,
    needs_spmd,
    resolve,
    run_rank,
)
from verl_core.config import VerlFlowConfig, load_config
from verl_core.runtime.run import RunContext
from verl_core.runtime.watchdog import StallError

# torchrun's report when rank 1 was killed with SIGKILL and rank 0 was then stopped by torchrun
KILLED = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
launcher.spmd FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-23_01:40:17
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 12449)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 12449
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_01:40:16
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12450)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 12450
============================================================
""".splitlines()

# a rank that raised: the traceback's last line is the error
RAISED = """
Root Cause (first observed failure):
[0]:
  rank      : 3 (local_rank: 1)
  exitcode  : 1 (pid: 77)
  error_file: /tmp/torchelastic/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "launcher/spmd.py", line 10, in wrapper
      return f(*args, **kwargs)
  ValueError: rank 3 ran out of prompts
============================================================
""".splitlines()


# the same kill where rank 0's collective failed first (an error file, timed before torchrun saw rank
# 1's exit), then torchrun stopped rank 0: its root cause is rank 0 (a CI run, 29 Nov)
KILLED_PEER_FIRST = """
============================================================
launcher.spmd FAILED
------------------------------------------------------------
Failures:
[0]:
  time      : 2026-11-29_16:43:34
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 27632)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 27632
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-11-29_16:43:33
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 27631)  (SIGTERM)
  error_file: /tmp/torchelastic_vp3dr2u5/attempt_0/0/error.json
  traceback : Traceback (most recent call last):
    File "launcher/spmd.py", line 260, in _worker
      result = run_rank(job)
  RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:28876.
============================================================
""".splitlines()


def test_a_killed_rank_is_named_over_the_peer_torchrun_stopped_after_it() -> None:
    assert failure_summary(KILLED_PEER_FIRST, 1) == (
        "rank 1 failed with exit code -9: Signal 9 (SIGKILL) received by PID 27632"
    )
    # a root cause torchrun did not stop itself stays the root cause, other failures whatever they are
    raised = [*KILLED_PEER_FIRST]
    raised[raised.index("  exitcode  : -15 (pid: 27631)  (SIGTERM)")] = "  exitcode  : 1 (pid: 27631)"
    assert failure_summary(raised, 1) == (
        "rank 0 failed with exit code 1: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection "
        "closed by peer [127.0.0.1]:28876."
    )


def test_a_killed_rank_is_named_with_its_signal() -> None:
    assert failure_summary(KILLED, 1) == (
        "rank 1 failed with exit code -9: Signal 9 (SIGKILL) received by PID 12450"
    )


def test_a_raised_error_is_the_tracebacks_last_line() -> None:
    assert (
        failure_summary(RAISED, 1) == "rank 3 failed with exit code 1: ValueError: rank 3 ran out of prompts"
    )


def test_without_a_report_the_exit_code_and_last_line() -> None:
    assert (
        failure_summary(["", "usage: torchrun ...", ""], 2)
        == "torchrun exited with code 2 (usage: torchrun ...)"
    )
    assert failure_summary([], 2) == "torchrun exited with code 2"


def test_a_config_runs_as_an_spmd_job_with_several_processes_or_a_sharded_engine() -> None:
    cfg = VerlFlowConfig()
    assert not needs_spmd(cfg)  # one process, 'single' everywhere
    assert needs_spmd(
        cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"n_gpus_per_node": 2})})
    )
    assert needs_spmd(cfg.model_copy(update={"actor": cfg.actor.model_copy(update={"strategy": "fsdp2"})}))
    # a critic's strategy counts only when there is a critic (grpo by default: none)
    critic = cfg.critic.model_copy(update={"strategy": "fsdp2"})
    assert not needs_spmd(cfg.model_copy(update={"critic": critic}))


def test_every_rank_runs_sft_under_the_stall_watchdog(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # issue 18: a rank stuck in the SFT stage (a collective that never returns, here a sleep) is failed
    # after execution.stall_timeout_s, naming the stage, as the RL loop's stages are on every rank
    import flows.gpu

    class Stuck:
        @staticmethod
        def fn(*args: Any) -> str:
            time.sleep(60)
            return "never"

    monkeypatch.setattr(flows.gpu, "sft_warmup", Stuck)
    monkeypatch.delenv(PREFECT_CONTEXT_ENV, raising=False)
    cfg = load_config(None, ["execution.stall_timeout_s=1"])
    job = SpmdJob(stage="sft", entry="flows.gpu:sft_rank", flow="flows.gpu:sft_flow",
                  ctx=RunContext(run_id="stuck", store_url=str(tmp_path)), config=cfg,
                  args={"template_pack_uri": "unused"}, final=True)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(StallError, match=r"^sft: no progress for 1 s \(execution.stall_timeout_s\)"):
        run_rank(job)  # one process: this is the main rank
    assert time.monotonic() - t0 < 5  # the timeout + a poll, not the sleep


def test_an_entry_point_is_resolved_from_its_import_path() -> None:
    # the job names what its ranks run; the launcher imports it only on the worker side
    assert resolve("launcher.spmd:failure_summary") is failure_summary
    with pytest.raises(SpmdJobError, match=r"^an SPMD entry point is 'module:name', got 'launcher.spmd'$"):
        resolve("launcher.spmd")


class _Joined(Exception):
    """Stops the worker once it has joined the process group."""


def test_the_worker_joins_through_init_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 36 item 11: one function joins every rank; on a (faked) CUDA host it sets the device from
    # LOCAL_RANK, then joins with NCCL beside gloo, under the launcher's join timeout
    import torch.distributed as dist

    import launcher.spmd
    from tests.verl_core.training.test_distributed import fake_platform
    from verl_core.training import distributed

    calls = fake_platform(monkeypatch, local_rank=1)
    monkeypatch.setenv("VERL_FLOW_JOIN_TIMEOUT_S", "90")
    real = distributed.init_distributed
    used: list[tuple[str, float]] = []

    def spy(device_type: str, timeout_s: float = 0.0) -> tuple[int, int]:
        used.append((device_type, timeout_s))
        return real(device_type, timeout_s)

    def stop(_job: str) -> None:
        raise _Joined

    monkeypatch.setattr(distributed, "init_distributed", spy)
    monkeypatch.setattr(launcher.spmd, "_receive_job", stop)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: None)
    with pytest.raises(_Joined):
        launcher.spmd._worker("job.json")
    assert used == [("cuda", 90.0)]
    assert [c[:2] for c in calls] == [("set_device", 1), ("init_process_group", "cpu:gloo,cuda:nccl")]


class _Exited(Exception):
    """Stands in for os._exit in the tests below."""


def test_a_finished_rank_runs_its_exit_handlers_then_exits_past_finalization(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DeepSpeed (its world group) and FSDP2 (a model state in a reference cycle) keep the gloo group
    # alive past destroy_process_group; finalization could then end a gloo thread through a noexcept
    # destructor (SIGABRT after the result is written): a rank that finished its job runs the exit
    # handlers (logging, trackers) first, then os._exit(0); a rank whose job failed raises as usual
    import atexit
    import types

    import torch.distributed as dist

    import launcher.spmd
    from verl_core.runtime import ranks
    from verl_core.training import distributed

    order: list[str] = []
    job = types.SimpleNamespace(stage="rl", final=True, result_path=None)
    monkeypatch.setattr(distributed, "init_distributed", lambda *a: (0, 1))
    monkeypatch.setattr(launcher.spmd, "_receive_job", lambda _arg: job)
    monkeypatch.setattr(launcher.spmd, "run_rank", lambda _job: order.append("run"))
    monkeypatch.setattr(ranks, "barrier", lambda: order.append("barrier"))
    monkeypatch.setattr(ranks, "is_main", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: order.append("destroy"))
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: order.append("exit handlers"))

    def fake_exit(code: int) -> None:
        order.append(f"os._exit({code})")
        raise _Exited

    monkeypatch.setattr(launcher.spmd.os, "_exit", fake_exit)
    with pytest.raises(_Exited):
        launcher.spmd._worker("job.json")
    assert order == ["run", "barrier", "destroy", "exit handlers", "os._exit(0)"]

    # a failed job: the group destroyed, the error raised (torchrun's record writes it), no os._exit
    order.clear()

    def fail(_job: object) -> None:
        order.append("run")
        raise ValueError("bad batch")

    monkeypatch.setattr(launcher.spmd, "run_rank", fail)
    with pytest.raises(ValueError, match="bad batch"):
        launcher.spmd._worker("job.json")
    assert order == ["run", "destroy"]
