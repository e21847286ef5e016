"""Scorers behind HTTP: a remote batch-scoring endpoint and an LLM judge, both ``(RewardBatch) ->
ScorerOutput`` and both on the client of :mod:`verl_core.reward.http` (auth, timeouts, retries,
concurrency).

Remote wire format (scorer ``remote``): the batch is cut into requests of ``batch_size`` samples, each
``POST url`` with the JSON body::

    {"samples": [{"prompt": str, "response": str, "ground_truth": str, "data_source": str,
                  "extra_info": {...}}, ...]}

and the answer (HTTP 200)::

    {"scores": [float | null, ...], "errors": [str | null, ...]}   # "errors" optional

with one entry per sample, in order. ``errors[i]`` set (or ``scores[i]`` null or not a finite number)
errors sample i; an answer that is not that shape (not JSON, not an object, a wrong number of
scores) errors every sample of its request, with a message saying what was wrong. Errored samples
go through ``reward.on_error`` like any scorer's.

Judge (scorer ``judge``): one ``POST {base_url}/chat/completions`` per sample (OpenAI chat format,
one user message: ``template`` filled with prompt, response, ground_truth); the score is the last
match of ``score_pattern``'s group in the reply, divided by ``score_scale``. No match, or a score
outside [0, 1] after scaling, errors the sample (never a silent 0).
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

from verl_core.reward.http import HttpOptions, RequestStats, make_client, post_json, read_token, run_bounded
from verl_core.reward.scorers import RewardBatch, ScorerOutput

_Rows = tuple[list[float], list[str | None], int, bool]  # scores, errors, retries, request failed


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_scores(body: Any, n: int) -> tuple[list[float], list[str | None]]:
    """Scores and errors of n samples from a remote answer (wire format in the module docstring)."""
    scores = body.get("scores") if isinstance(body, dict) else None
    errors = body.get("errors") if isinstance(body, dict) else None
    if not isinstance(scores, list):
        problem = "answer is not a JSON object with a 'scores' list"
    elif len(scores) != n:
        problem = f"answer has {len(scores)} scores for {n} samples"
    elif errors is not None and not (isinstance(errors, list) and len(errors) == n):
        problem = f"answer's 'errors' is not a list of {n} entries"
    else:
        problem = None
    if problem is not None or scores is None:
        return [0.0] * n, [f"bad remote answer: {problem}"] * n
    out_scores: list[float] = []
    out_errors: list[str | None] = []
    for i, score in enumerate(scores):
        error = errors[i] if errors is not None else None
        if error is None and not _finite(score):
            error = f"score {score!r} is not a finite number"
        out_scores.append(float(score) if error is None else 0.0)
        out_errors.append(None if error is None else f"remote: {error}")
    return out_scores, out_errors


class RemoteScorer(NamedTuple):
    """Batches POSTed to ``url`` in requests of ``batch_size`` (wire format: module docstring)."""

    url: str
    batch_size: int
    http: HttpOptions

    def __call__(self, batch: RewardBatch) -> ScorerOutput:
        token = read_token(self.http.token_env)
        starts = list(range(0, batch.size, self.batch_size))
        with make_client(self.http) as client:

            def request(a: int) -> _Rows:
                rows = range(a, min(a + self.batch_size, batch.size))
                samples = [
                    {
                        "prompt": batch.prompt_text[i],
                        "response": batch.response_text[i],
                        "ground_truth": batch.ground_truth[i],
                        "data_source": batch.data_source[i],
                        "extra_info": batch.extra_info[i],
                    }
                    for i in rows
                ]
                reply = post_json(client, self.url, {"samples": samples}, self.http, token)
                if reply.error is not None:
                    return [0.0] * len(rows), [reply.error] * len(rows), reply.retries, True
                scores, errors = parse_scores(reply.body, len(rows))
                return scores, errors, reply.retries, False

            parts = run_bounded(request, starts, self.http.max_concurrency, progress="remote_requests")
        return _output(parts)


def parse_judge_score(text: str, pattern: re.Pattern[str], scale: float) -> tuple[float, str | None]:
    """The judge's score in [0, 1] from its reply ``text``: the last match of ``pattern``'s one group
    divided by ``scale``; or (0.0, why not)."""
    matches = pattern.findall(text)
    if not matches:
        return 0.0, f"no score in the judge's reply (pattern {pattern.pattern!r}): {text[-200:]!r}"
    try:
        value = float(matches[-1])
    except ValueError:
        return 0.0, f"judge score {matches[-1]!r} is not a number"
    score = value / scale
    if not (math.isfinite(score) and 0.0 <= score <= 1.0):
        return 0.0, f"judge score {value} / score_scale {scale} = {score} is outside [0, 1]"
    return score, None


def chat_reply_text(body: Any) -> str | None:
    """``choices[0].message.content`` of an OpenAI chat-completions answer (None: not that shape)."""
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


class JudgeScorer(NamedTuple):
    """An LLM judge on an OpenAI-compatible endpoint, one request per sample (module docstring)."""

    base_url: str
    model: str
    template: str
    score_pattern: str
    score_scale: float
    temperature: float
    max_tokens: int
    http: HttpOptions

    def __call__(self, batch: RewardBatch) -> ScorerOutput:
        token = read_token(self.http.token_env)
        url = f"{self.base_url}/chat/completions"
        pattern = re.compile(self.score_pattern)
        with make_client(self.http) as client:

            def judge(i: int) -> _Rows:
                message = self.template.format(
                    prompt=batch.prompt_text[i],
                    response=batch.response_text[i],
                    ground_truth=batch.ground_truth[i],
                )
                payload = {
                    "model": self.model,
                    "messages": [{"role": "user", "content": message}],
                    "temperature": self.temperature,
                    "max_tokens": self.max_tokens,
                }
                reply = post_json(client, url, payload, self.http, token)
                if reply.error is not None:
                    return [0.0], [reply.error], reply.retries, True
                text = chat_reply_text(reply.body)
                if text is None:
                    error = f"bad judge answer: no choices[0].message.content in {str(reply.body)[:200]!r}"
                    return [0.0], [error], reply.retries, False
                score, problem = parse_judge_score(text, pattern, self.score_scale)
                return [score], [problem], reply.retries, False

            parts = run_bounded(
                judge, range(batch.size), self.http.max_concurrency, progress="judged_samples"
            )
        return _output(parts)


def _output(parts: list[_Rows]) -> ScorerOutput:
    scores = [s for p in parts for s in p[0]]
    errors = [e for p in parts for e in p[1]]
    stats = RequestStats(len(parts), sum(p[2] for p in parts), sum(p[3] for p in parts))
    return ScorerOutput(scores, errors, metrics=stats.metrics())
