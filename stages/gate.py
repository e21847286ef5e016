"""Gate stage: the challenger (this run's exported policy, its eval) against the registry's champion
(its eval on the same held-out prompts with the same settings), and the promotion that follows.

The flow hands it both evals (the champion's reused or evaluated again, :mod:`stages.floor.champion`).
The decision is :func:`verl_core.algorithms.paired.decide` on per-prompt greedy correctness: exact
McNemar, a paired bootstrap interval of the accuracy difference, a guard per data source, and a floor
(``gate.min_accuracy``) for the first model when there is no champion. Writes the stage ``gate``::

    paired.parquet    one row per prompt: prompt_index, data_source, prompt_text, champion_correct,
                      challenger_correct (kind ``gate_pairs``)
    decision.json     the verdict, its one-line reason, every figure and guard, both models
    decision.md       the decision as a markdown table (the flow's Prefect artifact)

then, when the challenger is a registered version: a pass gives it the ``champion`` alias
(:func:`~stages.floor.registry.promote`), a reject records the decision on it
(:func:`~stages.floor.registry.record_decision`); tags ``verl_flow.gate.*`` on the challenger's MLflow
run and the champion's. A rerun with the same evals and settings is skipped (the decision was made).
"""

from __future__ import annotations

from typing import Any

from prefect import task

from stages.floor.champion import Champion, paired_answers, registered_version
from stages.floor.locations import GATE
from stages.floor.logging import stage_logger
from stages.floor.registry import promote, record_decision
from verl_core.algorithms.paired import GateDecision, decide
from verl_core.config import GateConfig
from verl_core.runtime.run import RunContext


@task(name="gate")
def gate(
    ctx: RunContext,
    g: GateConfig,
    challenger_eval_uri: str,
    champion: Champion | None,
    champion_eval_uri: str | None,
) -> str:
    """Decide on the challenger evaluated at ``challenger_eval_uri`` against ``champion`` (evaluated at
    ``champion_eval_uri``; both None: no champion yet) with the settings ``g`` (the config's ``gate``
    section) and promote or record; returns the gate stage's manifest URI (its summary holds
    ``verdict`` and ``line``)."""
    log = stage_logger(__name__)
    store = ctx.store()
    # 1. Skip when this very pair was decided with these settings
    inputs = {"challenger": challenger_eval_uri}
    if champion_eval_uri is not None:
        inputs["champion"] = champion_eval_uri
    params = {"gate": g.model_dump(mode="json"), "champion": champion.ref.uri if champion else None}
    stage = store.open_stage(ctx.run_id, GATE, params=params, inputs=inputs)
    if stage.done:
        log.info("gate: already decided (%s)", stage.manifest_uri)
        return stage.manifest_uri

    # 2. Pair the answers prompt by prompt (an error when the evals answered different prompts)
    pairs = paired_answers(store, challenger_eval_uri, champion_eval_uri)
    champ_col = pairs.column("champion_correct").to_pylist() if champion_eval_uri else None
    decision = decide(
        pairs.column("challenger_correct").to_pylist(),
        champ_col,
        pairs.column("data_source").to_pylist(),
        confidence=g.confidence,
        min_improvement=g.min_improvement,
        max_regression=g.max_regression,
        min_accuracy=g.min_accuracy,
        n_resamples=g.n_resamples,
        seed=g.seed,
    )

    # 3. Write the pairs and the decision record
    challenger = registered_version(store, challenger_eval_uri)
    record = {
        "verdict": decision.verdict,
        "line": decision.line(),
        "challenger": {"eval": challenger_eval_uri, "model": challenger, "run_id": ctx.run_id},
        "champion": None
        if champion is None
        else {"eval": champion_eval_uri, "model": champion.ref.uri, "export": champion.export_uri,
              "reused_eval": champion.stored_eval is not None},
        "decision": decision.to_dict(),
    }  # fmt: skip
    stage.write_table("paired.parquet", pairs, "gate_pairs")
    stage.write_json("decision.json", record)
    stage.write_bytes("decision.md", decision_markdown(decision, record).encode())

    # 4. Registry and tracking, then commit (a failure before the commit redoes the decision)
    tags = {"verl_flow.gate.verdict": decision.verdict, "verl_flow.gate.reason": decision.line()[:4000]}
    if challenger is not None and ctx.tracking_uri:
        name, version = challenger.removeprefix("models:/").rsplit("/", 1)
        summary = _registry_decision(decision, ctx.run_id, champion)
        if decision.passed:
            promote(ctx.tracking_uri, name, version, decision=summary, by="gate")
        else:
            record_decision(ctx.tracking_uri, name, version, {**summary, "by": "gate"})
    ctx.tracker().set_tags(tags)
    ctx.tracker().log_metrics(_metrics(decision), step=0)
    if champion is not None and champion.ref.mlflow_run_id and ctx.tracking_uri:
        _tag_champion_run(ctx.tracking_uri, champion.ref.mlflow_run_id, ctx.run_id, decision)
    uri = stage.commit(summary={"verdict": decision.verdict, "line": decision.line(), "model": challenger})
    log.info("%s", decision.line())
    return uri


def _registry_decision(decision: GateDecision, run_id: str, champion: Champion | None) -> dict[str, Any]:
    """The decision as the registry records it on the challenger's version."""
    return {
        "verdict": decision.verdict,
        "reason": decision.line(),
        "run_id": run_id,
        "against": champion.ref.uri if champion else "floor",
        "accuracy": decision.challenger.accuracy,
        "champion_accuracy": decision.champion.accuracy if decision.champion else None,
        "difference": decision.difference,
        "p_value": decision.p_value,
    }


def _metrics(decision: GateDecision) -> dict[str, float]:
    out = {"gate/accuracy": decision.challenger.accuracy, "gate/pass": float(decision.passed)}
    if decision.champion is not None and decision.difference is not None and decision.p_value is not None:
        out |= {
            "gate/champion_accuracy": decision.champion.accuracy,
            "gate/difference": decision.difference,
            "gate/p_value": decision.p_value,
        }
    return out


def _tag_champion_run(tracking_uri: str, mlflow_run_id: str, run_id: str, decision: GateDecision) -> None:
    """Tag the champion's MLflow run with the latest challenge it met."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    client.set_tag(mlflow_run_id, "verl_flow.gate.challenged_by", run_id)
    client.set_tag(mlflow_run_id, "verl_flow.gate.challenge_verdict", decision.verdict)


def decision_markdown(decision: GateDecision, record: dict[str, Any]) -> str:
    """The decision as markdown: verdict, both models, the figures and every guard."""

    def ci(lo: float, hi: float) -> str:
        return f"[{lo:.3f}, {hi:.3f}]"

    chal, champ = decision.challenger, decision.champion
    lines = [f"# gate: **{decision.verdict}**", "", decision.line(), ""]
    lines.append(f"- challenger: `{record['challenger']['model']}` (run `{record['challenger']['run_id']}`)")
    lines.append(
        f"- champion: `{record['champion']['model']}`" if record["champion"] else "- champion: none yet"
    )
    lines += ["", f"| | accuracy | {decision.confidence:.0%} CI | prompts |", "|---|---|---|---|"]
    lines.append(f"| challenger | {chal.accuracy:.3f} | {ci(chal.ci.low, chal.ci.high)} | {chal.prompts} |")
    if champ is not None and decision.difference_ci is not None and decision.discordant is not None:
        d = decision.difference_ci
        lines.append(
            f"| champion | {champ.accuracy:.3f} | {ci(champ.ci.low, champ.ci.high)} | {champ.prompts} |"
        )
        lines.append(
            f"| difference | {decision.difference:+.3f} | {ci(d.low, d.high)} (paired bootstrap) | |"
        )
        b, c = decision.discordant
        lines += [
            "",
            f"McNemar exact p = {decision.p_value:.4g} (champion alone right: {b}, challenger alone: {c})",
        ]
    lines += ["", "| guard | value | threshold | rule | ok |", "|---|---|---|---|---|"]
    for g in decision.guards:
        lines.append(
            f"| {g.name} | {g.value:.4g} | {g.threshold:.4g} | {g.rule} | {'yes' if g.ok else 'NO'} |"
        )
    if decision.by_source:
        lines += ["", "| data source | prompts | champion | challenger |", "|---|---|---|---|"]
        for s in decision.by_source:
            a = "—" if s.champion is None else f"{s.champion:.3f}"
            lines.append(f"| {s.source} | {s.prompts} | {a} | {s.challenger:.3f} |")
    return "\n".join(lines) + "\n"
