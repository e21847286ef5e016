"""Remote and judge scorers against a local HTTP server (conftest.py): scoring, auth refusal, timeouts,
retries, bad payloads, the concurrency limit, the judge's score parser, and the token never leaking."""

from __future__ import annotations

import logging
import random
import re
import time
from typing import Any

import pytest

from stages.floor.scorers import build_scorers, score_batch
from tests.verl_core.reward.conftest import FakeServer
from verl_core.config import RewardConfig, SandboxConfig, VerlFlowConfig
from verl_core.config.loader import flatten_config
from verl_core.reward import (
    HttpOptions,
    JudgeScorer,
    RemoteConfigError,
    RemoteScorer,
    RewardBatch,
    RewardError,
    WeightedScorer,
    score_rollouts,
)
from verl_core.reward.http import backoff_s
from verl_core.reward.remote import parse_judge_score

TOKEN = "canary-remote-token-5e1d-QwErTy"  # never to be seen in any message or log


def opts(**kw: Any) -> HttpOptions:
    base = dict(
        token_env=None, connect_timeout_s=1.0, read_timeout_s=2.0, max_retries=2, backoff_s=0.01,
        max_backoff_s=0.05, max_concurrency=2,
    )  # fmt: skip
    return HttpOptions(**{**base, **kw})


def make_batch(responses: list[str], truths: list[str] | None = None) -> RewardBatch:
    n = len(responses)
    return RewardBatch(
        group_id=list(range(n)),
        sample_index=[0] * n,
        data_source=["custom/qa"] * n,
        ground_truth=truths or ["42"] * n,
        prompt_text=[f"question {i}" for i in range(n)],
        response_text=responses,
        response_length=[3] * n,
        finish_reason=["stop"] * n,
        extra_info=[{"iteration": 0, "group_id": i} for i in range(n)],
    )


def test_remote_scores_in_requests_of_batch_size(scoring_server: FakeServer) -> None:
    batch = make_batch(["42", "41", "42", "ERR", "42"])
    out = RemoteScorer(scoring_server.url + "/score", 2, opts())(batch)
    # server: 1.0 when response == "42"; "ERR" is a per-sample error from the server
    assert out.scores == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert out.errors == [None, None, None, "remote: grader crashed", None]
    assert out.metrics == {"requests": 3.0, "retries": 0.0, "failed_requests": 0.0}  # ceil(5 / 2)
    sizes = sorted(len(r["samples"]) for r in scoring_server.state.requests)
    assert sizes == [1, 2, 2]
    first = next(
        r["samples"][0] for r in scoring_server.state.requests if r["samples"][0]["prompt"] == "question 0"
    )
    assert first == {
        "prompt": "question 0", "response": "42", "ground_truth": "42", "data_source": "custom/qa",
        "extra_info": {"iteration": 0, "group_id": 0},
    }  # fmt: skip


def test_remote_errors_go_through_on_error(scoring_server: FakeServer) -> None:
    scorer = WeightedScorer("remote", 1.0, RemoteScorer(scoring_server.url, 8, opts()))
    batch = make_batch(["42", "ERR"])
    result = score_rollouts(batch, [scorer], on_error="zero", max_response_length=8)
    assert result.scores == [1.0, 0.0]
    assert result.errors == [None, "remote: remote: grader crashed"]
    assert result.metrics["reward/errors"] == 1.0
    assert result.metrics["reward/remote/requests"] == 1.0
    with pytest.raises(RewardError, match=r"'remote' failed on row group_id=1.*grader crashed"):
        score_rollouts(batch, [scorer], on_error="fail", max_response_length=8)


def test_wrong_token_is_refused_naming_the_variable_not_the_token(
    scoring_server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    scoring_server.state.token = TOKEN
    scorer = RemoteScorer(scoring_server.url, 8, opts(token_env="REMOTE_RM_TOKEN", max_retries=3))
    batch = make_batch(["42"])
    monkeypatch.delenv("REMOTE_RM_TOKEN", raising=False)
    with pytest.raises(RemoteConfigError, match=r"environment variable REMOTE_RM_TOKEN .* is not set"):
        scorer(batch)
    assert scoring_server.state.requests == []  # nothing sent without the token

    wrong = TOKEN[::-1]
    monkeypatch.setenv("REMOTE_RM_TOKEN", wrong)
    # a configuration problem: the stage fails even under on_error="zero", and 401 is not retried
    with pytest.raises(RemoteConfigError) as info:
        score_rollouts(batch, [WeightedScorer("remote", 1.0, scorer)], on_error="zero", max_response_length=8)
    message = str(info.value)
    assert "HTTP 401" in message and "REMOTE_RM_TOKEN" in message and scoring_server.url in message
    assert wrong not in message and "Bearer ***" in message  # the server echoed the header: blanked
    assert len(scoring_server.state.requests) == 1

    monkeypatch.setenv("REMOTE_RM_TOKEN", TOKEN)
    assert scorer(batch).scores == [1.0]


def test_a_hanging_server_times_out_and_is_counted(scoring_server: FakeServer) -> None:
    scoring_server.state.mode = "hang"
    scorer = RemoteScorer(scoring_server.url, 2, opts(read_timeout_s=0.3, max_retries=1))
    t0 = time.monotonic()
    result = score_rollouts(
        make_batch(["42"] * 3),
        [WeightedScorer("remote", 1.0, scorer)],
        on_error="zero",
        max_response_length=8,
    )
    elapsed = time.monotonic() - t0
    # 2 requests in parallel, each 2 attempts x 0.3 s + a wait <= 0.01 s: about 0.6 s
    assert elapsed < 3.0, elapsed
    assert result.scores == [0.0] * 3 and result.metrics["reward/errors"] == 3.0
    assert all(e is not None and "ReadTimeout" in e and "read_timeout_s=0.3" in e for e in result.errors)
    assert result.metrics["reward/remote/retries"] == 2.0  # one per request
    assert result.metrics["reward/remote/failed_requests"] == 2.0
    assert len(scoring_server.state.requests) == 4


@pytest.mark.parametrize("status", [503, 429, 500])
def test_transient_failures_are_retried(scoring_server: FakeServer, status: int) -> None:
    scoring_server.state.fail_first, scoring_server.state.fail_status = 2, status
    out = RemoteScorer(scoring_server.url, 8, opts(max_retries=2))(make_batch(["42", "7"]))
    assert out.scores == [1.0, 0.0] and out.errors == [None, None]
    assert out.metrics == {"requests": 1.0, "retries": 2.0, "failed_requests": 0.0}
    assert len(scoring_server.state.requests) == 3


def test_retries_run_out(scoring_server: FakeServer) -> None:
    scoring_server.state.fail_first = 10
    out = RemoteScorer(scoring_server.url, 8, opts(max_retries=2))(make_batch(["42"]))
    assert out.errors[0] is not None and "HTTP 503" in out.errors[0] and "after 2 retries" in out.errors[0]
    assert len(scoring_server.state.requests) == 3


def test_a_connection_refused_is_retried_then_errored() -> None:
    server = FakeServer()  # bound, never served: then closed, so the port refuses
    url = server.url
    server.httpd.server_close()
    out = RemoteScorer(url, 8, opts(max_retries=1))(make_batch(["42"]))
    assert out.errors[0] is not None and "ConnectError" in out.errors[0]
    assert out.metrics == {"requests": 1.0, "retries": 1.0, "failed_requests": 1.0}


@pytest.mark.parametrize(
    ("status", "fatal"), [(400, False), (422, False), (403, True), (404, True)]
)  # fmt: skip
def test_client_errors_are_not_retried(scoring_server: FakeServer, status: int, fatal: bool) -> None:
    scoring_server.state.mode, scoring_server.state.status = "status", status
    scorer = RemoteScorer(scoring_server.url, 8, opts(max_retries=3))
    if fatal:
        with pytest.raises(RemoteConfigError, match=f"HTTP {status}"):
            scorer(make_batch(["42"]))
    else:
        out = scorer(make_batch(["42", "42"]))
        assert out.errors == [f"{scoring_server.url} answered HTTP {status}: 'bad request'"] * 2
    assert len(scoring_server.state.requests) == 1


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("not_json", r"not JSON: '<html>Bad Gateway</html>'"),
        ("wrong_length", r"bad remote answer: answer has [01] scores for [12] samples"),
        ("not_object", r"bad remote answer: answer is not a JSON object with a 'scores' list"),
        ("nan", r"remote: score nan is not a finite number"),
    ],
)
def test_bad_payloads_error_the_samples_of_the_request(
    scoring_server: FakeServer, mode: str, expected: str
) -> None:
    scoring_server.state.mode = mode
    out = RemoteScorer(scoring_server.url, 2, opts())(make_batch(["42", "1", "42"]))
    # requests of 2 and 1 samples: every sample errored, with what was wrong
    assert all(e is not None and re.search(expected, e) for e in out.errors), out.errors
    assert out.scores == [0.0, 0.0, 0.0] and len(scoring_server.state.requests) == 2


def test_the_concurrency_limit_holds(scoring_server: FakeServer) -> None:
    # 9 requests of 0.6 s each, 3 at a time: the limit is reached (the window is wide enough for three
    # threads to start on a loaded machine; 0.15 s was not always) and never passed
    scoring_server.state.delay_s = 0.6
    out = RemoteScorer(scoring_server.url, 1, opts(max_concurrency=3))(make_batch(["42"] * 9))
    assert out.scores == [1.0] * 9
    assert scoring_server.state.max_in_flight == 3


def test_backoff_is_jittered_exponential_and_capped() -> None:
    o = opts(backoff_s=1.0, max_backoff_s=5.0)
    rng = random.Random(0)
    # caps by retry: min(5, 1 * 2**k) = 1, 2, 4, 5, 5
    for k, cap in enumerate([1.0, 2.0, 4.0, 5.0, 5.0]):
        waits = [backoff_s(k, o, None, rng) for _ in range(200)]
        assert min(waits) >= 0 and max(waits) <= cap and max(waits) > 0.8 * cap
    assert backoff_s(0, o, 3.0, rng) == 3.0  # Retry-After above the jitter wins ...
    assert backoff_s(0, o, 60.0, rng) == 5.0  # ... capped at max_backoff_s


# --------------------------------------------------------------------------------------------------
# Judge


def judge(url: str, **kw: Any) -> JudgeScorer:
    return JudgeScorer(
        f"{url}/v1", "judge-model", "Q: {prompt}\nRef: {ground_truth}\nA: {response}",
        r"Score:\s*([0-9]+(?:\.[0-9]+)?)", 10.0, 0.0, 64, opts(**kw),
    )  # fmt: skip


def test_judge_parses_the_score_and_errors_when_it_cannot(scoring_server: FakeServer) -> None:
    scoring_server.state.judge_replies = {
        "a": "Close, one slip. Score: 7",
        "b": "Score: 2 at first, but on reflection Score: 9.5",
        "c": "I cannot grade this.",
        "d": "Score: 15",
    }
    batch = make_batch(["<<a>>", "<<b>>", "<<c>>", "<<d>>"])
    out = judge(scoring_server.url)(batch)
    # 7 / 10; the last match 9.5 / 10; no match; 15 / 10 > 1
    assert out.scores == [0.7, 0.95, 0.0, 0.0]
    assert out.errors[:2] == [None, None]
    assert out.errors[2] is not None and "no score in the judge's reply" in out.errors[2]
    assert "I cannot grade this." in out.errors[2]
    assert out.errors[3] is not None and "outside [0, 1]" in out.errors[3]
    assert out.metrics == {"requests": 4.0, "retries": 0.0, "failed_requests": 0.0}
    request = next(r for r in scoring_server.state.requests if "<<a>>" in r["messages"][0]["content"])
    assert request == {
        "model": "judge-model", "temperature": 0.0, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Q: question 0\nRef: 42\nA: <<a>>"}],
    }  # fmt: skip


def test_judge_shares_auth_and_retries(scoring_server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    scoring_server.state.token, scoring_server.state.fail_first = TOKEN, 0
    scoring_server.state.judge_replies = {"a": "Score: 10"}
    monkeypatch.setenv("JUDGE_TOKEN", "wrong")
    with pytest.raises(RemoteConfigError, match=r"/v1/chat/completions answered HTTP 401.*JUDGE_TOKEN"):
        judge(scoring_server.url, token_env="JUDGE_TOKEN")(make_batch(["<<a>>"]))
    monkeypatch.setenv("JUDGE_TOKEN", TOKEN)
    scoring_server.state.fail_first = 2  # counts requests so far: the refused one and one 503
    out = judge(scoring_server.url, token_env="JUDGE_TOKEN")(make_batch(["<<a>>"]))
    assert out.scores == [1.0] and out.metrics is not None and out.metrics["retries"] == 1.0


def test_parse_judge_score() -> None:
    pattern = re.compile(r"Score:\s*([0-9.]+)")
    assert parse_judge_score("Score: 3", pattern, 4.0) == (0.75, None)
    assert parse_judge_score("Score: 0", pattern, 4.0) == (0.0, None)
    score, error = parse_judge_score("Score: 1.2.3", pattern, 4.0)
    assert score == 0.0 and error == "judge score '1.2.3' is not a number"
    assert parse_judge_score("", pattern, 4.0)[1] is not None


# --------------------------------------------------------------------------------------------------
# Config → scorers, and the token kept out of everything


def test_build_scorers_from_config_and_score(
    scoring_server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    scoring_server.state.token = TOKEN
    monkeypatch.setenv("RM_TOKEN", TOKEN)
    remote = {"url": scoring_server.url, "token_env": "RM_TOKEN", "batch_size": 2, "read_timeout_s": 2.0}
    cfg = RewardConfig(scorers=["remote"], remote=remote, on_error="zero")
    [ws] = build_scorers(cfg, SandboxConfig())
    assert ws.name == "remote" and isinstance(ws.scorer, RemoteScorer)
    result = score_batch(cfg, SandboxConfig(), make_batch(["42", "1", "ERR"]), max_response_length=8)
    assert result.scores == [1.0, 0.0, 0.0] and result.correct == [True, False, False]
    assert result.metrics["reward/errors"] == 1.0 and result.metrics["reward/remote/requests"] == 2.0
    monkeypatch.delenv("RM_TOKEN")
    with pytest.raises(RemoteConfigError, match="RM_TOKEN"):
        build_scorers(
            cfg, SandboxConfig()
        )  # an unset variable fails when the scorers are built, before any rollout
    with pytest.raises(ValueError, match=r"reward\.remote\.url: required"):
        RewardConfig(scorers=["remote"])
    with pytest.raises(ValueError, match=r"token_env\n.*the name of an environment variable"):
        RewardConfig(remote={"token_env": "Bearer abc"})


def test_the_token_reaches_no_message_log_or_param(
    scoring_server: FakeServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("RM_TOKEN", TOKEN)
    state = scoring_server.state
    state.token = TOKEN
    seen: list[str] = []
    scorer = RemoteScorer(
        scoring_server.url, 8, opts(token_env="RM_TOKEN", read_timeout_s=0.3, max_retries=1)
    )
    for mode in ("ok", "not_json", "status", "hang"):
        state.mode = mode
        seen += [e or "" for e in scorer(make_batch(["42"])).errors]
    state.token = "another"  # 401, echoing our Authorization header
    with pytest.raises(RemoteConfigError) as info:
        scorer(make_batch(["42"]))
    seen.append(str(info.value))
    seen.append(repr(scorer))
    cfg = VerlFlowConfig(
        reward={"scorers": ["remote"], "remote": {"url": scoring_server.url, "token_env": "RM_TOKEN"}}
    )
    params = flatten_config(cfg)
    assert params["reward.remote.token_env"] == "RM_TOKEN"  # a variable's name is not redacted
    seen += [f"{k}={v}" for k, v in params.items()]
    seen.append(caplog.text)
    assert "Bearer ***" in str(info.value)  # control: the echo happened and was blanked
    assert not [s for s in seen if TOKEN in s]
