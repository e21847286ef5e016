"""Security: nothing we load can run code we did not write or configure, and secrets never leave
the environment.

* a scan of the code (AST, :mod:`tests.reliability.codescan`): no unrestricted unpickling (pickle,
  ``torch.load`` without ``weights_only=True``, ``yaml.load`` without a safe loader, ...), no
  ``trust_remote_code=True`` default, no ``eval``/``exec``, dynamic imports only where the configured
  reward function is loaded;
* ``trust_remote_code`` is off unless set: a model directory that ships its own code is refused and
  its code never runs;
* custom reward functions load only from the configured ``reward.function`` import path: not from a
  file path, and a row's ``data_source`` never imports anything;
* canary secrets in the environment of a real pipeline run (S3 keys used for real against the moto
  endpoint, tokens) appear in none of its outputs: stdout/stderr logs, every object in the store
  (run.json included), the MLflow database and artifacts, the Prefect database (flow parameters).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from stages.floor.policy import build_policy
from tests.reliability.codescan import scan_source, scan_tree
from tests.reliability.conftest import CANARIES, REPO, Pipeline, S3Run
from verl_core.config import ModelConfig, RewardConfig
from verl_core.errors import DataError
from verl_core.models.loading import ModelLoadError
from verl_core.reward import batch_from_columns, load_reward_function
from verl_core.reward.rules import RuleOptions
from verl_core.reward.scorers import score_rules

PRODUCTION = ["verl_core", "stages", "flows", "benchmarks", "infra"]
# vLLM pickles one function of ours to its own worker processes (apply_model needs
# VLLM_ALLOW_INSECURE_SERIALIZATION=1); nothing is unpickled from storage or the network.
KNOWN_OPT_INS = {"verl_core/rollout/vllm.py": "VLLM_ALLOW_INSECURE_SERIALIZATION"}


def test_code_has_no_unrestricted_deserialisation_or_remote_code() -> None:
    findings = scan_tree(REPO, PRODUCTION)
    assert [str(f) for f in findings] == []
    # the one opt-in to pickling elsewhere is where we know it is, and nowhere else
    for path in (p for pkg in PRODUCTION for p in (REPO / pkg).rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if "VLLM_ALLOW_INSECURE_SERIALIZATION" in path.read_text():
            assert rel in KNOWN_OPT_INS, rel


def test_scanner_flags_each_unsafe_pattern() -> None:
    bad = """
import pickle
from dill import loads
import torch, yaml, numpy as np, importlib
def f(trust_remote_code=True): ...
class M:
    trust_remote_code: bool = Field(True, "x")
torch.load("x")
torch.load("x", weights_only=False)
torch.load("x", weights_only=True)
pickle.loads(b"")
yaml.load(s)
yaml.load(s, Loader=yaml.SafeLoader)
np.load("x", allow_pickle=True)
AutoModel.from_pretrained("p", trust_remote_code=True)
eval("1")
importlib.import_module("os")
"""
    found = [(f.line, f.what) for f in scan_source(bad, "stages/x.py")]
    lines = sorted({line for line, _ in found})
    # hand-checked: every line above except the safe torch.load (10), the safe yaml.load (13) and
    # the plain imports (4)
    assert lines == [2, 3, 5, 7, 8, 9, 11, 12, 14, 15, 16, 17]
    assert scan_source("importlib.import_module(p)", "verl_core/reward/functions.py") == []


def test_remote_code_in_a_model_dir_is_refused_and_never_runs(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    ran = tmp_path / "code-ran"
    (model_dir / "modeling_evil.py").write_text(
        f"open({str(ran)!r}, 'w').write('pwned')\nfrom transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evil",
                "architectures": ["EvilForCausalLM"],
                "auto_map": {
                    "AutoConfig": "modeling_evil.EvilConfig",
                    "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
                },
            }
        )
    )
    model = ModelConfig(init="pretrained", path=str(model_dir))
    assert model.trust_remote_code is False
    with pytest.raises(ModelLoadError, match=r"(?s)model\.path: .*contains custom code.*trust_remote_code"):
        build_policy(model, tokenizer=None, seed=1)
    assert not ran.exists()


def test_reward_functions_load_only_from_the_configured_import_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = tmp_path / "code-ran"
    evil = tmp_path / "evil_reward.py"
    evil.write_text(f"open({str(ran)!r}, 'w').write('pwned')\ndef f(*a, **k):\n    return 1.0\n")
    # validating a config that names the file runs nothing (loading it is what the user asked for)
    assert RewardConfig(scorers=["function"], function=f"{evil}:f").function == f"{evil}:f"
    assert not ran.exists()
    # a data_source naming a module is an unknown data source for the rule scorer, nothing imported
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = {
        "group_id": [0], "sample_index": [0], "data_source": ["evil_reward:f"], "ground_truth": ["1"],
        "prompt_text": ["q"], "response_text": ["#### 1"], "response_length": [3], "finish_reason": ["stop"],
    }  # fmt: skip
    batch = batch_from_columns(pa.table(rows))
    with pytest.raises(DataError, match=r"rule reward: .*'evil_reward:f'"):
        score_rules(
            batch.response_text,
            batch.ground_truth,
            batch.data_source,
            RuleOptions("strict", 1.0, 0.0),
            num_workers=0,
            parallel_min_samples=10,
        )
    assert "evil_reward" not in sys.modules and not ran.exists()
    # the configured path is the one that loads
    assert RewardConfig(scorers=["function"], function="evil_reward:f").function == "evil_reward:f"
    assert load_reward_function("evil_reward:f")() == 1.0
    assert ran.exists()  # (control: the same module does run when it is the configured one)


def _grep(needles: dict[str, str], blobs: dict[str, bytes]) -> list[str]:
    return [
        f"{var} in {where}"
        for where, data in blobs.items()
        for var, v in needles.items()
        if v.encode() in data
    ]


def test_canary_secrets_reach_no_output(s3_faulty_run: S3Run, pipeline: Pipeline) -> None:
    run = s3_faulty_run
    assert run.result.returncode == 0, run.result.output[-5000:]
    from verl_core.store import ArtifactStore

    store = ArtifactStore(run.store_url)
    outputs: dict[str, bytes] = {"stdout": run.result.stdout.encode(), "stderr": run.result.stderr.encode()}
    for path in store.fs.find(store.root):  # every object of the store, run.json included
        outputs[f"s3://{path}"] = store.fs.cat_file(path)
    for base in (run.workdir, pipeline.prefect_home):  # MLflow db + artifacts; Prefect db + logs
        for path in base.rglob("*"):
            if path.is_file():
                outputs[str(path)] = path.read_bytes()
    # controls: the grep sees each kind of output (the run id is in every one of them)
    for kind in ("stdout", "/runs/faulty/run.json", "mlflow.db", "prefect.db"):
        assert any(kind in k and b"faulty" in v for k, v in outputs.items()), kind
    assert b"AKIA" not in b"".join(v for k, v in outputs.items() if k.endswith("run.json"))
    assert _grep(CANARIES, outputs) == []


@pytest.mark.parametrize("backend", ["bwrap", "weak"])
def test_canary_secrets_do_not_reach_sandboxed_code(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Code the python tool or the code scorer runs sees none of the parent's secrets: the environment
    is empty (both backends), and no host process's /proc/<pid>/environ is readable (bwrap: its own pid
    namespace; weak: only when verl-flow runs as root, which runs the code as nobody; as any other
    user the weak backend's code can read that user's processes' environments, as its warning says)."""
    from verl_core.runtime import sandbox

    if backend == "bwrap" and sandbox.bwrap_problem() is not None:
        pytest.skip(f"bubblewrap cannot run here ({sandbox.bwrap_problem()}); `make install` installs it")
    for k, v in CANARIES.items():
        monkeypatch.setenv(k, v)
    dump = """
import os
print(dict(os.environ))
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            print(pid, open(f"/proc/{pid}/environ", "rb").read())
        except OSError as e:
            print(pid, type(e).__name__)
"""
    spec = sandbox.SandboxSpec(backend, 5.0, 5, 256, 16, 1 << 20, 4)  # type: ignore[arg-type]
    if backend == "weak" and os.geteuid() != 0:
        dump = dump[: dump.index("for pid")]
    text = sandbox.python_tool(dump, spec)
    assert "error" not in text.splitlines()[0], text
    assert not [k for k, v in CANARIES.items() if v in text]
