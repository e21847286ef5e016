"""Serving: one real vLLM server (``.venv-vllm``) for the module, started the way a user starts it:
``verl-flow serve models:/serve-model@champion`` as a subprocess (foreground), the registered version
being the export of a tiny run (registered here with the tags the export stage writes). What talks to
it: the official ``openai`` SDK (models, completions, chat, streaming, tool-call settings, errors),
``/v1/completions`` and ``/v1/chat/completions`` with the export's chat template, ``verl-flow eval
--endpoint`` against the in-process eval of the same export, the judge scorer, the remote scorer
(whose wire format vLLM does not serve), a second serve on the busy port; the last test stops the
server with SIGTERM and checks that nothing is left (no process of its group, no record, no
directory). The tiny policy (hidden 64, 2 heads: CPU attention needs head size >= 32) memorises the
answers of half the held-out prompts, so greedy accuracy is strictly between 0 and 1.

The server starts in ~60 s on 2 idle cores (the readiness wait allows 300 s); the module runs ~2-3 min.
The lifecycle without vLLM (detach, status/stop, replacement, failures): test_serve_lifecycle.py."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.runs import start_run
from stages.export import export_model
from stages.floor.artifacts import load_tokenizer, write_policy
from stages.floor.locations import ckpt_stage, template_pack_uri
from stages.floor.policy import build_policy
from stages.floor.reports import read_eval_report
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from tests.memorised import Replay, memorise
from tests.vllm_env import vllm_python
from verl_core.config import VerlFlowConfig, validate_config
from verl_core.reward import HttpOptions, JudgeScorer, RemoteScorer, RewardBatch
from verl_core.runtime import serve_records as records
from verl_core.runtime.run import RunContext
from verl_core.runtime.serving import group_alive, serves

RUN = "serve-run"
MODEL = "serve-model"  # the registered model; version 1 is the run's export, alias champion
SERVED = f"{MODEL}/1"  # the name responses carry
MEMORISED = 4  # of the 8 held-out prompts, the first 4 are trained on
REPO = Path(__file__).resolve().parents[2]
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


def _register(root: Path) -> str:
    """Register the run's export as version 1 of MODEL, alias champion, with the tags the export stage
    writes (run id, export manifest URI); returns the tracking URI."""
    from mlflow.tracking import MlflowClient

    from verl_core.store import ArtifactStore

    st = ArtifactStore(str(root))
    tracking = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=tracking)
    client.create_registered_model(MODEL)
    tags = {"verl_flow.run_id": RUN, "verl_flow.export_uri": st.manifest_uri(RUN, "export/iter-0001")}
    client.create_model_version(MODEL, source=str(root), tags=tags)
    client.set_registered_model_alias(MODEL, "champion", "1")
    return tracking


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Served:
    """The module's server: the foreground ``verl-flow serve`` process and the record it wrote."""

    cli: subprocess.Popen[str]
    record: records.ServeRecord
    env: dict[str, str]
    tmp: Path  # the serve process's TMPDIR

    @property
    def url(self) -> str:
        return self.record.url

    @property
    def model(self) -> str:
        return self.record.names[0]


@pytest.fixture(scope="module")
def server(run: tuple[Path, VerlFlowConfig], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``verl-flow serve models:/MODEL@champion`` (fp32 like the export, eager, hermes tool calls)."""
    root, _ = run
    tracking = _register(root)
    state = tmp_path_factory.mktemp("serve-state")
    tmp = tmp_path_factory.mktemp("serve-tmp")
    env = {
        **os.environ,
        records.STATE_ENV: str(state),
        "VERL_FLOW_VLLM_PYTHON": vllm_python(),
        "TMPDIR": str(tmp),
    }
    cmd = [
        str(REPO / ".venv/bin/verl-flow"), "serve", f"models:/{MODEL}@champion", "--store", str(root),
        "--tracking-uri", tracking, "--port", str(_free_port()), "--dtype", "float32",
        "--vllm-enforce-eager", "--cpu-kv-cache-gib", "1", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    cli = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    old = os.environ.get(records.STATE_ENV)
    os.environ[records.STATE_ENV] = str(state)  # this process reads the same records
    try:
        deadline = time.monotonic() + 420  # CLI imports + the readiness wait (300 s)
        while (record := records.read_record(MODEL)) is None:
            if cli.poll() is not None or time.monotonic() > deadline:
                cli.kill()
                pytest.fail(f"verl-flow serve did not start:\n{cli.communicate()[0]}")
            time.sleep(1)
        yield Served(cli, record, env, tmp)
    finally:
        if cli.poll() is None:
            cli.send_signal(signal.SIGTERM)
            cli.wait(120)
        if old is None:
            os.environ.pop(records.STATE_ENV, None)
        else:
            os.environ[records.STATE_ENV] = old


def _val_rows(root: Path) -> list[dict]:
    from verl_core.store import ArtifactStore

    st = ArtifactStore(str(root))
    return st.read_table(
        st.read_manifest(template_pack_uri(st, RUN)), "prompt_tokens/val.parquet"
    ).to_pylist()


def test_server_answers_completions_and_chat_with_the_export_template(
    run: tuple[Path, VerlFlowConfig], server: Served
) -> None:
    root, _ = run
    assert server.model == SERVED  # the version first: every response names it
    command = Path(f"/proc/{server.record.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--chat-template" in command  # the export's chat_template.jinja
    row = _val_rows(root)[0]
    done = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": SERVED, "prompt": row["prompt_text"], "max_tokens": 8, "temperature": 0,
              "add_special_tokens": False, "return_token_ids": True},
        timeout=120,
    ).json()  # fmt: skip
    assert done["choices"][0]["prompt_token_ids"] == row["input_ids"]  # the server's tokenizer is the run's
    assert done["choices"][0]["text"] == f"#### {row['ground_truth']}"  # memorised; <|im_end|> is eos

    # chat: vLLM renders the messages with the export's template; the prompt ids must be those of our
    # rendering (template_pack's prompt_text, tokenized by the run's tokenizer)
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": f"{MODEL}@champion", "messages": row["prompt"], "max_tokens": 8, "temperature": 0,
              "return_token_ids": True},
        timeout=120,
    ).json()  # fmt: skip
    assert chat["prompt_token_ids"] == row["input_ids"]
    assert chat["choices"][0]["message"]["content"] == f"#### {row['ground_truth']}"


def test_eval_endpoint_gives_the_in_process_accuracy(
    run: tuple[Path, VerlFlowConfig], server: Served
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


def test_judge_scorer_against_the_server(run: tuple[Path, VerlFlowConfig], server: Served) -> None:
    root, cfg = run
    j = cfg.reward.judge
    scorer = JudgeScorer(
        f"{server.url}/v1", SERVED, j.template, j.score_pattern, j.score_scale, 0.0, 16, HTTP
    )
    out = scorer(_batch(root, ["#### 1", "#### 2"]))
    # both requests reached the server and came back as chat answers (no failed request); the tiny
    # arithmetic model does not write "Score: N", so each sample is either scored in [0, 1] or errored
    # with the parser's message, never silently 0 without an error
    assert out.metrics == {"requests": 2.0, "retries": 0.0, "failed_requests": 0.0}
    for score, error in zip(out.scores, out.errors, strict=True):
        assert (error is None and 0.0 <= score <= 1.0) or (
            score == 0.0 and error is not None and error.startswith("no score in the judge's reply")
        ), (score, error)


def test_remote_scorer_cannot_use_a_vllm_server(run: tuple[Path, VerlFlowConfig], server: Served) -> None:
    """The remote scorer's wire format ({"samples": [...]} → {"scores": [...]}) is not an OpenAI or vLLM
    endpoint: pointed at the server's /v1/completions, the request is refused (HTTP 400) and every
    sample errors with the server's answer, counted as one failed request."""
    root, _ = run
    out = RemoteScorer(f"{server.url}/v1/completions", 8, HTTP)(_batch(root, ["#### 1", "#### 2"]))
    assert out.scores == [0.0, 0.0]
    assert all(e is not None and "answered HTTP 400" in e for e in out.errors), out.errors
    assert out.metrics == {"requests": 1.0, "retries": 0.0, "failed_requests": 1.0}


def test_openai_sdk_sees_the_version_and_weights(run: tuple[Path, VerlFlowConfig], server: Served) -> None:
    """What a user's client reads: the served names (version, alias) and, as each model's root, the
    sha256 of the weights, which is that of the store's model.safetensors (the record says the same).
    The export is served from the store itself (a local store: no copy)."""
    root, _ = run
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED, f"{MODEL}@champion"]
    [weights] = root.glob(f"runs/{RUN}/export/iter-0001/*/model/model.safetensors")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert {(m.model_extra or {})["root"] for m in models} == {server.record.root}
    assert server.record.root.endswith(f"/sha256-{digest}") and server.record.digest == digest
    assert Path(server.record.model_dir) == weights.parent and server.record.version == "1"
    status = runner.invoke(app, ["serve", "status", MODEL])
    assert status.exit_code == 0 and "running" in status.output and digest[:16] in status.output


def test_openai_sdk_completions_chat_streaming_and_errors(
    run: tuple[Path, VerlFlowConfig], server: Served
) -> None:
    root, _ = run
    row = _val_rows(root)[0]
    answer = f"#### {row['ground_truth']}"  # memorised; <|im_end|> is eos
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model=SERVED, prompt=row["prompt_text"], max_tokens=8, temperature=0)
    assert done.model == SERVED and done.choices[0].text == answer
    chat = client.chat.completions.create(
        model=f"{MODEL}@champion", messages=row["prompt"], max_tokens=8, temperature=0
    )
    assert chat.model == SERVED and chat.choices[0].message.content == answer  # by alias, answered by v1
    stream = client.chat.completions.create(
        model=SERVED, messages=row["prompt"], max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer
    # tool calling is on (--tool-call-parser hermes): tool_choice=auto is accepted (vLLM answers 400
    # without --enable-auto-tool-choice); the tiny model answers in text, without a tool call
    calculator = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
                  "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                 "required": ["expression"]}}}  # fmt: skip
    tooled = client.chat.completions.create(
        model=SERVED,
        messages=row["prompt"],
        max_tokens=8,
        temperature=0,
        tools=[calculator],
        tool_choice="auto",
    )
    assert tooled.choices[0].message.content == answer and not tooled.choices[0].message.tool_calls
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model=RUN, prompt="1+1=", max_tokens=2)  # not a served name
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED, prompt="1+1=", max_tokens=10**6)  # past max_model_len


def test_busy_port_is_refused_in_one_line(run: tuple[Path, VerlFlowConfig], server: Served) -> None:
    """A second serve on the server's port: one line, nothing started; the running server is intact
    (and readiness would not have taken it for the new one: it does not list that name)."""
    root, _ = run
    done = runner.invoke(app, ["serve", RUN, "--store", str(root), "--port", str(server.record.port)])
    assert done.exit_code == 1
    assert done.stderr.strip().splitlines() == [
        f"error: port {server.record.port} on 127.0.0.1 is in use: choose another --port, or stop what "
        "holds it (verl-flow serve status lists the servers started here)"
    ]
    assert records.read_record(RUN) is None
    assert serves(server.url, [SERVED], server.record.root)
    assert not serves(server.url, [RUN], server.record.root)  # another name: not ours
    assert not serves(server.url, [SERVED], "/elsewhere")  # another model directory: not ours


def test_sigterm_stops_the_server_and_leaves_nothing(server: Served) -> None:
    """Last of the module: SIGTERM to the foreground serve (timeout, systemd, docker stop) stops vLLM
    and its engine process (its process group), removes the record and the weights link, and leaves
    no directory behind."""
    pid = server.record.pid
    members = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout.split()
    assert len(members) >= 2  # the API server and the engine core
    server.cli.send_signal(signal.SIGTERM)
    output = server.cli.communicate(timeout=120)[0]
    assert server.cli.returncode == 0 and output.rstrip().endswith("stopped"), output
    assert not group_alive(pid)
    for _ in range(100):  # an exited member's zombie lasts until its new parent (init) reaps it: 10 s
        left = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True).stdout
        if not left:
            break
        time.sleep(0.1)
    assert left == b""
    assert records.read_record(MODEL) is None and not Path(server.record.root).is_symlink()
    assert Path(server.record.log).is_file()  # the log stays
    left = [p for p in server.tmp.rglob("*") if p.name == "config.json" or "verl-flow" in p.name]
    assert left == [], sorted(os.listdir(server.tmp))  # no copy of the model, no directory of ours
