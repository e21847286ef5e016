"""The serve lifecycle a supervisor relies on, without vLLM: a stand-in server
(tests/flows/fake_vllm_server.py: answers /v1/models within a second, has a child in its process
group as vLLM's engine core is) started the way ``verl-flow serve`` starts vLLM.

Busy port refused in one line; readiness means /v1/models lists OUR names and root; SIGTERM / SIGINT
to a foreground serve leave no process of its group and no directory; --detach + serve status/stop;
stale records; a second serve of a name refused, --replace and the serve-model flow replace it
(through the record); failed starts leave nothing but the log; the digest and served names of
models:/ targets (MLflow registry), run ids and directories; the tool-call parser; the serve-model
deployment's promotion trigger."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import flows.serving as serving
from flows.cli import app
from verl_core.runtime import serve_records as records
from verl_core.runtime.serving import ServeConfig, group_alive, server_command, server_facts, weights_digest
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(directory: Path, weights: bytes) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (directory / "model.safetensors").write_bytes(weights)
    return directory


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """State dir under tmp_path and the stand-in as the vLLM interpreter; stops whatever a test left."""
    fake = tmp_path / "vllm-python"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests/flows/fake_vllm_server.py"} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv(records.STATE_ENV, str(tmp_path / "state"))
    monkeypatch.setenv("VERL_FLOW_VLLM_PYTHON", str(fake))
    (tmp_path / "tmp").mkdir()  # the temporary directory of this process and the ones it starts
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    yield {**os.environ}
    for record, _ in records.read_records():
        records.stop_record(record, timeout_s=5)


def _status() -> list[dict[str, Any]]:
    done = runner.invoke(app, ["serve", "status", "--json"])
    assert done.exit_code == 0, done.output
    return list(json.loads(done.stdout))


def test_weights_digest_is_sha256sum() -> None:
    one, two = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"b").hexdigest()
    # one weights file: its own sha256 (what `sha256sum model.safetensors` prints); other files ignored
    assert weights_digest({"model.safetensors": one, "config.json": two}) == one
    # shards: the sha256 of sha256sum's output for them, sorted by name
    lines = f"{one}  model-00001-of-00002.safetensors\n{two}  model-00002-of-00002.safetensors\n"
    shards = {"model-00002-of-00002.safetensors": two, "model-00001-of-00002.safetensors": one}
    assert weights_digest(shards) == hashlib.sha256(lines.encode()).hexdigest()


def test_detach_status_stop(env: dict[str, str], tmp_path: Path) -> None:
    model = _model(tmp_path / "tiny", b"weights-1")
    port = _free_port()
    done = runner.invoke(
        app, ["serve", str(model), "--port", str(port), "--detach", "--tool-call-parser", "hermes"]
    )
    assert done.exit_code == 0, done.output
    [rec] = _status()
    digest = hashlib.sha256(b"weights-1").hexdigest()
    assert (rec["state"], rec["name"], rec["names"], rec["port"]) == ("running", "tiny", ["tiny"], port)
    assert rec["digest"] == digest and rec["detached"] is True and rec["version"] is None
    # vLLM is given the digest-named link to the directory (no copy): /v1/models' root says the digest
    assert rec["root"].endswith(f"/tiny/sha256-{digest}") and Path(rec["root"]).resolve() == model
    assert rec["model_dir"] == str(model)
    log = Path(rec["log"]).read_text()  # the stand-in prints its arguments
    assert "--enable-auto-tool-choice" in log and '"--tool-call-parser", "hermes"' in log
    assert group_alive(rec["pid"])

    stopped = runner.invoke(app, ["serve", "stop", "tiny"])
    assert stopped.exit_code == 0 and f"stopped tiny (pid {rec['pid']}" in stopped.output
    assert not group_alive(rec["pid"])  # the server and its child (the engine's stand-in)
    assert not Path(rec["root"]).is_symlink() and Path(rec["log"]).is_file()  # the log stays
    assert _status() == []
    assert runner.invoke(app, ["serve", "status"]).output.strip() == "no servers"


def test_stale_record_is_reported_and_removed(env: dict[str, str], tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = records.ServeRecord(
        name="old", target="old", pid=gone.pid, host="127.0.0.1", port=1, url="http://127.0.0.1:1",
        names=["old"], version=None, digest="0" * 64, model_dir="/nowhere", root="/nowhere",
        log="/nowhere/server.log", started=records.now(), owner_pid=gone.pid, detached=True,
    )  # fmt: skip
    records.write_record(stale)
    [rec] = _status()
    assert rec["name"] == "old" and rec["state"].startswith("stale")
    assert records.read_record("old") is None and _status() == []


def test_busy_port_is_refused_in_one_line(env: dict[str, str], tmp_path: Path) -> None:
    model = _model(tmp_path / "tiny", b"w")
    with socket.socket() as other:  # another server holds the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        done = runner.invoke(app, ["serve", str(model), "--port", str(port)])
    assert done.exit_code == 1
    assert done.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is in use: choose another --port, or stop what holds it "
        "(verl-flow serve status lists the servers started here)"
    ]
    assert records.read_records() == [] and not (records.record_dir("tiny") / records.LOG).exists()


def test_another_servers_models_are_not_taken_for_ours(env: dict[str, str], tmp_path: Path) -> None:
    """A server that answers /health and /v1/models, but not with our names: not ready; the start
    fails after the timeout, its process group is stopped and nothing but the log is left."""
    model = _model(tmp_path / "tiny", b"w")
    done = runner.invoke(
        app,
        ["serve", str(model), "--port", str(_free_port()), "--health-timeout-s", "3"],
        env={**env, "FAKE_VLLM_MODELS_AS": "someone-else"},
    )
    assert done.exit_code == 1 and "did not list 'tiny'" in done.output, done.output
    pid = int(re.search(r"fake vLLM pid (\d+)", done.output)[1])  # type: ignore[index]
    assert not group_alive(pid)  # the server and its child
    assert records.read_records() == []
    assert sorted(p.name for p in records.record_dir("tiny").iterdir()) == [records.LOG]
    assert os.listdir(tempfile.gettempdir()) == []  # no directory left behind


def test_serve_reports_a_dying_server_with_its_log(env: dict[str, str], tmp_path: Path) -> None:
    model = _model(tmp_path / "model", b"w")
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\necho 'loading...'\necho 'RuntimeError: no CPU kernels for head size 8' >&2\nexit 3\n"
    )
    fake.chmod(0o755)
    done = runner.invoke(
        app,
        ["serve", str(model), "--health-timeout-s", "30"],
        env={**env, "VERL_FLOW_VLLM_PYTHON": str(fake)},
    )
    assert done.exit_code == 1
    assert "exited with code 3 before it was healthy" in done.output
    assert "no CPU kernels for head size 8" in done.output  # the log's tail
    assert records.read_records() == [] and not list(records.record_dir("model").glob("sha256-*"))


def test_serve_refuses_an_unknown_target(tmp_path: Path) -> None:
    done = runner.invoke(app, ["serve", "no-such-run", "--store", str(tmp_path)])
    assert done.exit_code == 1
    assert "neither models:/NAME@ALIAS, a model directory (config.json) nor a run" in done.output
    bad = runner.invoke(app, ["serve", str(tmp_path), "--port", "0"])
    assert bad.exit_code == 2 and "port" in bad.output


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT as a terminal's foreground process has it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_a_foreground_serve_stops_its_group(
    env: dict[str, str], tmp_path: Path, sig: signal.Signals
) -> None:
    """What `timeout`, systemd, `docker stop` or a Prefect cancellation send (SIGTERM), or Ctrl-C.
    The CLI starts as from a terminal, with SIGINT's default disposition and unblocked: an ignored
    or blocked signal is inherited across fork and exec, and a pytest worker's state after other
    tests is not a terminal's (Ctrl-C to a process that inherited SIGINT ignored means nothing)."""
    model = _model(tmp_path / "tiny", b"w")
    cli = subprocess.Popen(
        [str(REPO / ".venv/bin/verl-flow"), "serve", str(model), "--port", str(_free_port())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_terminal_sigint,
    )  # fmt: skip
    deadline = time.monotonic() + 180  # the CLI's imports (torch) take ~20 s on 2 busy cores
    while (rec := records.read_record("tiny")) is None:
        assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()[0]
        time.sleep(0.2)
    assert rec.owner_pid == cli.pid and not rec.detached and group_alive(rec.pid)
    masks = [ln for ln in Path(f"/proc/{cli.pid}/status").read_text().splitlines() if ln.startswith("Sig")]
    cli.send_signal(sig)
    try:
        output = cli.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        cli.kill()
        raise AssertionError(f"{sig.name} did not stop the CLI; its signal state: {masks}") from None
    assert cli.returncode == 0 and output.rstrip().endswith("stopped"), output
    # a pipe is no terminal: the console's 80 columns must not break a path onto two lines (logs and
    # scripts read the model directory and the URL from these lines)
    assert f"starting vLLM on {model} (log " in output, output
    assert not group_alive(rec.pid)  # the server and its child: no orphan
    assert records.read_record("tiny") is None and not Path(rec.root).is_symlink()
    assert os.listdir(tempfile.gettempdir()) == []  # no directory left behind


def test_a_served_name_is_refused_then_replaced(env: dict[str, str], tmp_path: Path) -> None:
    model = _model(tmp_path / "tiny", b"w")
    assert runner.invoke(app, ["serve", str(model), "--port", str(_free_port()), "--detach"]).exit_code == 0
    first = records.read_record("tiny")
    assert first is not None
    again = runner.invoke(app, ["serve", str(model), "--port", str(_free_port()), "--detach"])
    assert again.exit_code == 1 and f"tiny is already served at {first.url} (pid {first.pid})" in again.output
    port = _free_port()
    done = runner.invoke(app, ["serve", str(model), "--port", str(port), "--detach", "--replace"])
    assert done.exit_code == 0, done.output
    second = records.read_record("tiny")
    assert second is not None and second.port == port and not group_alive(first.pid)


def test_serve_model_flow_replaces_the_server_of_its_name(env: dict[str, str], tmp_path: Path) -> None:
    """The deployment's flow run on a promotion replaces the server the previous run holds (same name,
    same port): the record moves to the new weights' digest and the previous flow run completes."""
    old, new = _model(tmp_path / "a" / "m", b"night-1"), _model(tmp_path / "b" / "m", b"night-3")
    settings = ServeConfig(port=_free_port())
    results: dict[str, Any] = {}

    def run(key: str, target: Path) -> None:
        results[key] = serving.serve_model.fn(str(target), str(tmp_path / "store"), settings)

    def wait_digest(weights: bytes) -> records.ServeRecord:
        deadline = time.monotonic() + 60
        while (rec := records.read_record("m")) is None or rec.digest != hashlib.sha256(weights).hexdigest():
            assert time.monotonic() < deadline, results
            time.sleep(0.2)
        return rec

    first = threading.Thread(target=run, args=("first", old))
    first.start()
    one = wait_digest(b"night-1")
    second = threading.Thread(target=run, args=("second", new))
    second.start()
    three = wait_digest(b"night-3")
    first.join(30)
    assert results["first"] == "replaced: m" and not group_alive(one.pid)
    assert three.pid != one.pid and three.port == one.port and Path(three.root).resolve() == new
    records.stop_record(three)  # `verl-flow serve stop m`
    second.join(30)
    assert results["second"] == "replaced: m" and records.read_records() == []


def _registered_store(tmp_path: Path) -> tuple[str, str, bytes]:
    """(store url, tracking uri, weights) of a run 'r1' trained with tools whose export (a minimal
    model dir) is version 1 of registered model 'm', alias champion, tagged as the export stage tags
    it (run id, export manifest URI)."""
    from mlflow.tracking import MlflowClient

    store = ArtifactStore(str(tmp_path / "store"))
    store.write_run_record("r1", {"rollout": {"multi_turn": {"enable": True, "tools": ["calculator"]}}}, "h")
    stage = store.open_stage("r1", "export/iter-0001", params={})
    weights = b"registered weights"
    stage.write_bytes("model/config.json", json.dumps({"model_type": "qwen2"}).encode())
    stage.write_bytes("model/model.safetensors", weights)
    uri = stage.commit()
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=tracking)
    client.create_registered_model("m")
    tags = {"verl_flow.run_id": "r1", "verl_flow.export_uri": uri}
    version = client.create_model_version("m", source=str(tmp_path), tags=tags)
    client.set_registered_model_alias("m", "champion", version.version)
    return store.url, tracking, weights


def test_models_uri_resolves_to_the_export_in_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(records.STATE_ENV, str(tmp_path / "state"))
    store_url, tracking, weights = _registered_store(tmp_path)
    champ = serving.resolve_model("models:/m@champion", store_url, tracking)
    # responses carry m/1 (the version that answered); the alias is listed too
    assert (champ.name, champ.names, champ.version) == ("m", ["m/1", "m@champion"], "1")
    assert champ.digest == hashlib.sha256(weights).hexdigest()  # from the manifest: nothing read
    assert champ.model_dir.is_relative_to(tmp_path / "store")  # a local store: served in place
    assert champ.tool_call_parser(None) == "hermes"  # the run trained with tools
    assert champ.tool_call_parser("none") is None and champ.tool_call_parser("mistral") == "mistral"
    pinned = serving.resolve_model("models:/m/1", store_url, tracking)
    assert pinned.names == ["m/1"] and pinned.model_dir == champ.model_dir
    assert not (tmp_path / "state").exists()  # no copy, no cache


def test_tool_call_flags(tmp_path: Path) -> None:
    def cmd(parser: str | None) -> list[str]:
        return server_command(
            "py", tmp_path, ServeConfig(), ["m/1", "m@champion"], server_facts(True), parser
        )

    with_tools = cmd("hermes")
    assert with_tools[with_tools.index("--tool-call-parser") + 1] == "hermes"
    assert "--enable-auto-tool-choice" in with_tools
    assert "--enable-auto-tool-choice" not in cmd(None) and "--tool-call-parser" not in cmd("none")
    names = with_tools[with_tools.index("--served-model-name") + 1 :][:2]
    assert names == ["m/1", "m@champion"]


def test_serve_model_deployment_follows_promotions() -> None:
    """prefect.yaml: serve-model runs on every verl-flow.model.promoted event (promotion or rollback),
    serving models:/NAME@champion of the event's model, with parameters the flow takes."""
    import inspect

    import jinja2

    [deployment] = [d for d in yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
                    if d["name"] == "serve-model"]  # fmt: skip
    [trigger] = deployment["triggers"]
    assert trigger["name"] == "serve-on-model-promoted" and trigger["description"]
    assert trigger["type"] == "event" and trigger["expect"] == ["verl-flow.model.promoted"]
    assert trigger["match"] == {"prefect.resource.id": "verl-flow.model.*"}
    assert trigger["enabled"] == "{{ team.enabled }}"  # off until the team's store is configured
    assert set(trigger["parameters"]) <= set(inspect.signature(serving.serve_model.fn).parameters)
    payload = {"name": "gsm8k-ppo", "version": "3", "previous": "2", "by": "gate"}
    target = jinja2.Template(trigger["parameters"]["target"]).render(event={"payload": payload})
    assert target == "models:/gsm8k-ppo@champion"


def test_a_remote_stores_export_is_written_out_once_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a local store (memory:// here, S3 in production): the export is written into the state
    directory's cache, named by its manifest's sha256, once; later serves reuse it; no partial copy."""
    monkeypatch.setenv(records.STATE_ENV, str(tmp_path / "state"))
    store = ArtifactStore("memory://serve-remote-store")
    stage = store.open_stage("r2", "export/iter-0002", params={})
    stage.write_bytes("model/config.json", json.dumps({"model_type": "qwen2"}).encode())
    stage.write_bytes("model/model.safetensors", b"remote weights")
    uri = stage.commit()
    first = serving.resolve_model("r2", store.url)
    assert first.model_dir == records.cache_dir() / store.manifest_sha256(uri)
    assert (first.model_dir / "model.safetensors").read_bytes() == b"remote weights"
    assert (
        first.digest == hashlib.sha256(b"remote weights").hexdigest() and first.tool_call_parser(None) is None
    )
    stamp = (first.model_dir / "config.json").stat().st_mtime_ns
    again = serving.resolve_model("r2", store.url)
    assert (
        again.model_dir == first.model_dir and (again.model_dir / "config.json").stat().st_mtime_ns == stamp
    )
    assert [p.name for p in records.cache_dir().iterdir()] == [first.model_dir.name]
