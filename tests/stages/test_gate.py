"""Gate stage: the first model against the floor, a better challenger promoted, a worse one rejected
with the alias unmoved, the champion's eval reused or evaluated again on this run's prompts (never
compared across prompts), a champion whose export is gone, and gate.require_promotion's verdict.

Three tiny runs share one store and one SQLite MLflow registry: ``a`` and ``b`` have the same held-out
prompts, ``c`` fewer (data.arithmetic_val_size). Random tiny policies answer no arithmetic right, so
the pass and reject cases pair doctored copies of real evals: the same rows with ``correct`` set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from flows.gating import PromotionRefused, require_promotion
from flows.results import GateOutcome
from flows.runs import start_run
from stages.eval import evaluate
from stages.export import export_model
from stages.floor.artifacts import export_source
from stages.floor.champion import find_champion, paired_answers
from stages.floor.locations import template_pack_uri
from stages.floor.registry import champion
from stages.gate import gate
from stages.preprocess import preprocess
from stages.template_pack import template_pack
from tests.stages.test_export import _checkpoint
from verl_core.config import VerlFlowConfig, validate_config, with_overrides
from verl_core.errors import ArtifactError, ArtifactNotFoundError
from verl_core.runtime.run import RunContext
from verl_core.store import ArtifactStore

TINY: dict[str, Any] = {
    "data": {
        "arithmetic_train_size": 32,
        "arithmetic_val_size": 8,
        "max_response_length": 4,
        "truncation": "right",
    },
    "model": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
    "trainer": {"experiment_name": "gate-test", "device": "cpu"},
    "eval": {"k": 1},  # greedy only: the gate reads greedy correctness
    "gate": {"enable": True, "n_resamples": 500},
}
NAME = "verl-flow-gate-test"  # {trainer.project_name}-{trainer.experiment_name}


class Run:
    """One tiny run: its context, config, template_pack, registered export and that export's eval."""

    def __init__(self, root: Path, run_id: str, val_size: int, seed: int) -> None:
        raw = {**TINY, "store": {"url": str(root)}, "data": {**TINY["data"], "arithmetic_val_size": val_size}}
        self.cfg: VerlFlowConfig = validate_config(raw)
        self.ctx: RunContext = start_run(self.cfg, run_id)
        store = self.ctx.store()
        template_pack.fn(self.ctx, self.cfg.data, self.cfg.model, preprocess.fn(self.ctx, self.cfg.data))
        self.tp = template_pack_uri(store, run_id)
        _checkpoint(self.ctx, self.cfg, seed)
        self.export = export_model.fn(self.ctx, self.cfg, self.tp, seed)
        self.version = store.read_manifest(self.export).summary["registered_model"]["version"]
        self.eval = evaluate.fn(self.ctx, self.cfg, self.tp, export_source(store, self.export))


def _doctored(store: ArtifactStore, eval_uri: str, label: str, correct: list[bool]) -> str:
    """A copy of the eval at ``eval_uri`` as ``eval/{label}`` (same inputs) whose greedy answers are
    ``correct``."""
    m = store.read_manifest(eval_uri)
    inputs = {k: v["uri"] for k, v in m.inputs.items()}
    stage = store.open_stage(m.run_id, f"eval/{label}", params={"correct": correct}, inputs=inputs)
    if not stage.done:
        rewards = store.read_table(m, "greedy/rewards.parquet")
        i = rewards.schema.get_field_index("correct")
        rewards = rewards.set_column(i, "correct", pa.array(correct, pa.bool_()))
        rollouts = store.read_table(m, "greedy/rollouts.parquet")
        stage.write_table("greedy/rollouts.parquet", rollouts, "rollouts")
        stage.write_table("greedy/rewards.parquet", rewards, "rewards")
        stage.commit(summary={})
    return stage.manifest_uri


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("gate")
    return {"a": Run(root, "a", 8, 1), "b": Run(root, "b", 8, 2), "c": Run(root, "c", 6, 3)}


def _decision(store: ArtifactStore, gate_uri: str) -> dict[str, Any]:
    return json.loads(store.read_bytes(store.read_manifest(gate_uri), "decision.json"))


def test_gate_floor_promotion_reuse_reject_and_reevaluation(runs: dict[str, Run]) -> None:
    from mlflow.tracking import MlflowClient

    a, b, c = runs["a"], runs["b"], runs["c"]
    store, uri = a.ctx.store(), a.ctx.tracking_uri
    assert uri is not None and champion(uri, NAME) is None

    # night a: no champion; accuracy 0/8 ≥ gate.min_accuracy 0 → pass, version a becomes champion
    first = gate.fn(a.ctx, a.cfg.gate, a.eval, None, None)
    d = _decision(store, first)
    assert d["verdict"] == "pass" and d["champion"] is None
    assert [g["name"] for g in d["decision"]["guards"]] == ["floor"]
    held = champion(uri, NAME)
    assert held is not None and held.version == a.version
    assert held.decision["verdict"] == "pass" and held.decision["by"] == "gate"
    pairs = store.read_table(store.read_manifest(first), "paired.parquet")
    assert pairs.num_rows == 8 and pairs.column("champion_correct").null_count == 8
    assert gate.fn(a.ctx, a.cfg.gate, a.eval, None, None) == first  # rerun: decided already

    # run b has a's prompts and eval settings: a's stored eval is reused, not evaluated again
    found = find_champion(store, b.cfg, held, b.tp)
    assert found.export_uri == a.export and found.stored_eval == a.eval
    # other eval settings (gate.* or eval.max_samples): a's eval is not the same measurement
    other = with_overrides(b.cfg, ["eval.max_samples=4"])
    assert find_champion(store, other, held, b.tp).stored_eval is None

    # b better on every prompt (c=8, b=0: p = 2/2^8 = 0.0078 < 0.05; every resample d* = 1) → promoted
    b_good = _doctored(store, b.eval, "export-good", [True] * 8)
    a_bad = _doctored(store, a.eval, "export-bad", [False] * 8)
    passed = gate.fn(b.ctx, b.cfg.gate, b_good, found, a_bad)
    d = _decision(store, passed)
    assert d["verdict"] == "pass", d["line"]
    assert d["decision"]["p_value"] == pytest.approx(2 / 256) and d["decision"]["discordant"] == [0, 8]
    assert d["decision"]["difference_ci"] == {"low": 1.0, "high": 1.0}
    client = MlflowClient(tracking_uri=uri)
    aliases = {k: str(v) for k, v in client.get_registered_model(NAME).aliases.items()}
    assert aliases == {"champion": b.version, "previous-champion": a.version}
    assert client.get_run(b.ctx.mlflow_run_id).data.tags["verl_flow.gate.verdict"] == "pass"
    assert client.get_run(a.ctx.mlflow_run_id).data.tags["verl_flow.gate.challenged_by"] == "b"
    md = store.read_bytes(store.read_manifest(passed), "decision.md").decode()
    assert "# gate: **pass**" in md and "| significance |" in md

    # run c is worse than champion b: rejected, the alias does not move, c's version records why
    held = champion(uri, NAME)
    assert held is not None and held.version == b.version
    found = find_champion(store, c.cfg, held, c.tp)
    assert found.stored_eval is None  # c has 6 held-out prompts, b's eval answered 8: evaluate again
    with pytest.raises(ArtifactError, match="answered other prompts"):
        paired_answers(store, c.eval, b.eval)  # never compared blindly
    again = evaluate.fn(c.ctx, c.cfg, c.tp, found.source)
    assert store.read_manifest(again).stage == f"eval/champion-v{b.version}"
    assert store.read_manifest(again).run_id == "c"  # on c's prompts, in c's run
    c_metrics = client.get_run(c.ctx.mlflow_run_id).data.metrics
    assert "gate/champion/accuracy" in c_metrics  # c's own eval/accuracy stays c's policy's
    assert len(client.get_metric_history(c.ctx.mlflow_run_id, "eval/accuracy")) == 1
    c_bad = _doctored(store, c.eval, "export-bad", [False] * 6)
    b_on_c = _doctored(store, again, "champion-good", [True] * 6)
    rejected = gate.fn(c.ctx, c.cfg.gate, c_bad, found, b_on_c)
    d = _decision(store, rejected)
    assert d["verdict"] == "reject" and "significance failed" in d["line"]
    assert store.read_table(store.read_manifest(rejected), "paired.parquet").num_rows == 6
    assert str(client.get_registered_model(NAME).aliases["champion"]) == b.version  # unmoved
    version_c = client.get_model_version(NAME, c.version)
    assert version_c.tags["verl_flow.decision.verdict"] == "reject"

    # gate.require_promotion: the rejection ends the run with the decision's one line
    outcome = GateOutcome.model_validate(store.read_manifest(rejected).summary)
    require_promotion(c.cfg, outcome)  # not required: the run completes, its result names the decision
    with pytest.raises(PromotionRefused, match=r"^gate: reject: .*significance failed"):
        require_promotion(with_overrides(c.cfg, ["gate.require_promotion=true"]), outcome)

    # a champion whose export is gone: an error naming the version and the export
    store.delete_stage("b", store.read_manifest(b.export).stage)
    with pytest.raises(ArtifactNotFoundError, match=f"champion models:/{NAME}/{b.version}: its export"):
        find_champion(store, c.cfg, held, c.tp)
