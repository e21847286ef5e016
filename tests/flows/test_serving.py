"""Serving: one real vLLM server (``.venv-vllm``) on the export of a tiny run, started once for the module
through ``flows.serving`` (run id → its latest export), and what talks to it: ``/v1/completions``,
``/v1/chat/completions`` with the export's chat template, ``verl-flow eval --endpoint`` against the
in-process eval of the same export, the judge scorer, and the remote scorer (whose wire format vLLM
does not serve). The tiny policy (hidden 64, 2 heads: CPU attention needs head size >= 32) memorises
the answers of half the held-out prompts, so greedy accuracy is strictly between 0 and 1.

The server starts in ~60 s on 2 idle cores (the health wait allows 300 s); the module runs ~2 min.
Failure paths of ``verl-flow serve`` run without vLLM (a stand-in interpreter that dies)."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.serving import resolve_model, serve
from stages.export import export_model
from stages.floor.artifacts import load_tokenizer, write_policy
from stages.floor.builders import build_policy
from stages.floor.locations import ckpt_stage, template_pack_uri
from stages.floor.reports import read_eval_report
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from tests.memorised import Replay, memorise
from tests.vllm_env import vllm_python
from verl_core.config import RolloutConfig, VerlFlowConfig, validate_config
from verl_core.reward import HttpOptions, JudgeScorer, RemoteScorer, RewardBatch
from verl_core.runtime.run import RunContext, start_run
from verl_core.runtime.serving import ServeConfig, ServerHandle

RUN = "serve-run"
MEMORISED = 4  # of the 8 held-out prompts, the first 4 are trained on
runner = CliRunner()


def _config(root: Path) -> VerlFlowConfig:
    return validate_config(
        {
            "store": {"url": str(root)},
            "data": {"arithmetic_train_size": 32, "arithmetic_val_size": 8},
            "model": {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                      "num_key_value_heads": 2},
            "eval": {"k": 1},
            "trainer": {"experiment_name": "serve-test", "device": "cpu"},
            "tracking": {"enabled": False},
        }
    )  # fmt: skip


def _memorise(ctx: RunContext, cfg: VerlFlowConfig, tp_uri: str) -> None:
    """Commit ckpt/iter-0001: a scratch policy trained to answer the first MEMORISED held-out prompts
    with ``#### {ground truth}<|im_end|>`` (loss on the answer tokens only), until greedy decoding
    replays them with a checked margin on any CPU (tests/memorised.py)."""
    store = ctx.store()
    tokenizer = load_tokenizer(store, tp_uri)
    prompts = store.read_table(store.read_manifest(tp_uri), "prompt_tokens/val.parquet").slice(0, MEMORISED)
    rows = []
    for ids, truth in zip(
        prompts.column("input_ids").to_pylist(), prompts.column("ground_truth").to_pylist(), strict=True
    ):
        answer = tokenizer(f"#### {truth}<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append(Replay(ids, answer, [1] * len(answer)))
    lm = memorise(build_policy(cfg.model, tokenizer, seed=1), rows)
    stage = store.open_stage(ctx.run_id, ckpt_stage(1), params={"iteration": 1})
    write_policy(stage, "policy", lm, tokenizer, cfg.model)
    stage.commit(summary={"iteration": 1})


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, VerlFlowConfig]:
    """(store root, config) of a run with a committed export of the memorising policy."""
    vllm_python()  # fail / skip before any work when the vLLM environment is missing
    root = tmp_path_factory.mktemp("serve-store")
    cfg = _config(root)
    ctx = start_run(cfg, RUN)
    tp = template_pack.fn(ctx, cfg.data, cfg.model, preprocess.fn(ctx, cfg.data))
    _memorise(ctx, cfg, tp)
    export_model.fn(ctx, cfg, tp, 1)
    return root, cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(
    run: tuple[Path, VerlFlowConfig], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    """The one vLLM server of the module, on the run's latest export (fp32 like the export, eager)."""
    root, _ = run
    work = tmp_path_factory.mktemp("serve-work")
    vllm = RolloutConfig(vllm_enforce_eager=True, cpu_kv_cache_gib=1, vllm_python=vllm_python())
    settings = ServeConfig(port=_free_port(), dtype="float32", rollout=vllm)
    with serve(resolve_model(RUN, str(root), work), settings, work / "server.log") as handle:
        yield handle


def _val_rows(root: Path) -> list[dict]:
    from verl_core.store import ArtifactStore

    st = ArtifactStore(str(root))
    return st.read_table(
        st.read_manifest(template_pack_uri(st, RUN)), "prompt_tokens/val.parquet"
    ).to_pylist()


def test_server_answers_completions_and_chat_with_the_export_template(
    run: tuple[Path, VerlFlowConfig], server: ServerHandle
) -> None:
    root, _ = run
    assert server.model == RUN  # served under the run id by default
    assert "--chat-template" in server.command  # the export's chat_template.jinja
    row = _val_rows(root)[0]
    done = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": RUN, "prompt": row["prompt_text"], "max_tokens": 8, "temperature": 0,
              "add_special_tokens": False, "return_token_ids": True},
        timeout=120,
    ).json()  # fmt: skip
    assert done["choices"][0]["prompt_token_ids"] == row["input_ids"]  # the server's tokenizer is the run's
    assert done["choices"][0]["text"] == f"#### {row['ground_truth']}"  # memorised; <|im_end|> is eos

    # chat: vLLM renders the messages with the export's template; the prompt ids must be those of our
    # rendering (template_pack's prompt_text, tokenized by the run's tokenizer)
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": RUN, "messages": row["prompt"], "max_tokens": 8, "temperature": 0,
              "return_token_ids": True},
        timeout=120,
    ).json()  # fmt: skip
    assert chat["prompt_token_ids"] == row["input_ids"]
    assert chat["choices"][0]["message"]["content"] == f"#### {row['ground_truth']}"


def test_eval_endpoint_gives_the_in_process_accuracy(
    run: tuple[Path, VerlFlowConfig], server: ServerHandle
) -> None:
    from verl_core.store import ArtifactStore

    root, _ = run
    here = runner.invoke(app, ["eval", RUN, "--store", str(root)])
    assert here.exit_code == 0, here.output
    there = runner.invoke(app, ["eval", RUN, "--store", str(root), "--endpoint", server.url])
    assert there.exit_code == 0, there.output
    st = ArtifactStore(str(root))
    uris = {
        m.stage: st.manifest_uri(RUN, m.stage) for m in st.list_manifests(RUN) if m.stage.startswith("eval/")
    }
    local = read_eval_report(st, uris["eval/export-iter-0001"])
    (endpoint_stage,) = [s for s in uris if s.startswith("eval/endpoint-")]
    remote = read_eval_report(st, uris[endpoint_stage])
    # partly right: (most of) the MEMORISED prompts, (almost surely) none of the others
    assert 0 < local.accuracy < 1
    assert remote.accuracy == local.accuracy and remote.prompts == local.prompts == 8
    texts = [
        st.read_table(st.read_manifest(uris[s]), "greedy/rollouts.parquet")
        .column("response_text")
        .to_pylist()
        for s in ("eval/export-iter-0001", endpoint_stage)
    ]
    assert texts[0] == texts[1]  # same greedy responses, token for token in text
    assert re.search(r"all\s*│\s*8\s*│\s*" + f"{local.accuracy:.3f}", there.output.replace("┃", "│"))


def _batch(root: Path, responses: list[str]) -> RewardBatch:
    rows = _val_rows(root)[: len(responses)]
    n = len(rows)
    return RewardBatch(
        group_id=list(range(n)), sample_index=[0] * n, data_source=[r["data_source"] for r in rows],
        ground_truth=[r["ground_truth"] for r in rows], prompt_text=[r["prompt"][0]["content"] for r in rows],
        response_text=responses, response_length=[3] * n, finish_reason=["stop"] * n, extra_info=[{}] * n,
    )  # fmt: skip


HTTP = HttpOptions(
    token_env=None, connect_timeout_s=5.0, read_timeout_s=120.0, max_retries=0, backoff_s=0.1,
    max_backoff_s=0.1, max_concurrency=2,
)  # fmt: skip


def test_judge_scorer_against_the_server(run: tuple[Path, VerlFlowConfig], server: ServerHandle) -> None:
    root, cfg = run
    j = cfg.reward.judge
    scorer = JudgeScorer(f"{server.url}/v1", RUN, j.template, j.score_pattern, j.score_scale, 0.0, 16, HTTP)
    out = scorer(_batch(root, ["#### 1", "#### 2"]))
    # both requests reached the server and came back as chat answers (no failed request); the tiny
    # arithmetic model does not write "Score: N", so each sample is either scored in [0, 1] or errored
    # with the parser's message, never silently 0 without an error
    assert out.metrics == {"requests": 2.0, "retries": 0.0, "failed_requests": 0.0}
    for score, error in zip(out.scores, out.errors, strict=True):
        assert (error is None and 0.0 <= score <= 1.0) or (
            score == 0.0 and error is not None and error.startswith("no score in the judge's reply")
        ), (score, error)


def test_remote_scorer_cannot_use_a_vllm_server(
    run: tuple[Path, VerlFlowConfig], server: ServerHandle
) -> None:
    """The remote scorer's wire format ({"samples": [...]} → {"scores": [...]}) is not an OpenAI or vLLM
    endpoint: pointed at the server's /v1/completions, the request is refused (HTTP 400) and every
    sample errors with the server's answer, counted as one failed request."""
    root, _ = run
    out = RemoteScorer(f"{server.url}/v1/completions", 8, HTTP)(_batch(root, ["#### 1", "#### 2"]))
    assert out.scores == [0.0, 0.0]
    assert all(e is not None and "answered HTTP 400" in e for e in out.errors), out.errors
    assert out.metrics == {"requests": 1.0, "retries": 0.0, "failed_requests": 1.0}


# ------------------------------------------------------------------ failure paths, without vLLM


def test_serve_reports_a_dying_server_with_its_log(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 'loading...'\necho 'RuntimeError: no CPU kernels for head size 8' >&2\nexit 3\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    done = runner.invoke(
        app,
        ["serve", str(model), "--health-timeout-s", "30"],
        env={**os.environ, "VERL_FLOW_VLLM_PYTHON": str(fake)},
    )
    assert done.exit_code == 1
    assert "exited with code 3 before it was healthy" in done.output
    assert "no CPU kernels for head size 8" in done.output  # the log's tail


def test_serve_refuses_an_unknown_target(tmp_path: Path) -> None:
    done = runner.invoke(app, ["serve", "no-such-run", "--store", str(tmp_path)])
    assert done.exit_code == 1
    assert "neither a model directory (config.json) nor a run" in done.output
    bad = runner.invoke(app, ["serve", str(tmp_path), "--port", "0"])
    assert bad.exit_code == 2 and "port" in bad.output
