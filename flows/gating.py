"""The gate step of the pipeline: find the registry's champion, reuse its eval or evaluate it again on
this run's prompts (the eval stage, as ``eval/champion-v{version}``), decide (the gate stage), show
the decision as a Prefect markdown artifact; and the CI verdict: :class:`PromotionRefused` when
``gate.require_promotion`` is set and the challenger was rejected."""

from __future__ import annotations

from flows.results import GateOutcome
from stages.eval import evaluate
from stages.floor.champion import find_champion, registered_version
from stages.floor.locations import GATE
from stages.floor.registry import champion
from stages.gate import gate
from verl_core.config import VerlFlowConfig
from verl_core.errors import ConfigError, VerlFlowError
from verl_core.runtime.run import RunContext


class PromotionRefused(VerlFlowError):
    """The gate rejected the run's challenger and the run required a promotion; the message is the
    decision's one line."""


def run_gate(
    ctx: RunContext, cfg: VerlFlowConfig, template_pack_uri: str, eval_uri: str
) -> tuple[str | None, GateOutcome]:
    """The gate on the export evaluated at ``eval_uri``: ``(gate stage URI, outcome)``; the URI is None
    when this run's export already holds the alias and no gate stage of the run says why."""
    store = ctx.store()
    model = registered_version(store, eval_uri)
    if model is None or not ctx.tracking_uri:
        raise ConfigError(
            "gate.enable: the exported policy is not a registered model version; the gate needs "
            "export.register_model=true and MLflow tracking (tracking.enabled, tracking.uri)"
        )
    name = model.removeprefix("models:/").rsplit("/", 1)[0]
    ref = champion(ctx.tracking_uri, name)
    if ref is not None and ref.uri == model:  # a rerun after this run's export was promoted
        done = store.committed(ctx.run_id, GATE)
        if done is not None:
            return store.manifest_uri(ctx.run_id, GATE), GateOutcome.model_validate(done.summary)
        return None, GateOutcome(
            verdict="pass", line=f"gate: pass: {model} is the champion already", model=model
        )
    found = None if ref is None else find_champion(store, cfg, ref, template_pack_uri)
    champion_eval = None
    if found is not None:
        champion_eval = found.stored_eval or evaluate(ctx, cfg, template_pack_uri, found.source)
    uri = gate(ctx, cfg.gate, eval_uri, found, champion_eval)
    _publish(ctx, uri)
    return uri, GateOutcome.model_validate(store.read_manifest(uri).summary)


def require_promotion(cfg: VerlFlowConfig, outcome: GateOutcome | None) -> None:
    """Raise :class:`PromotionRefused` with the decision's line when ``gate.require_promotion`` is set
    and the gate rejected the challenger."""
    if cfg.gate.require_promotion and outcome is not None and outcome.verdict != "pass":
        raise PromotionRefused(outcome.line)


def _publish(ctx: RunContext, gate_uri: str) -> None:
    """The decision's markdown (``gate/decision.md``) as the flow run's ``gate-decision`` artifact."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:  # called outside a flow run: no run to attach it to
        return
    store = ctx.store()
    text = store.read_bytes(store.read_manifest(gate_uri), "decision.md").decode()
    create_markdown_artifact(text, key="gate-decision", description=f"gate of run {ctx.run_id}")
