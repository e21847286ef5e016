"""Config keys followed to what reads them: each set to a value other than its default, the object
its reader builds (a spec, a scorer, a lease, a dispatched deployment, a prompt table) carries it.
The keys here are those no other test named (tests/verl_core/config/test_keys_used.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from flows import dispatch
from flows.runs import start_run, wandb_fields
from stages.floor.policy import build_policy, mixed_precision, quant_spec
from stages.floor.scorers import build_scorers
from stages.floor.specs import actor_spec, optim_spec, planned_iterations, ppo_spec
from stages.preprocess import preprocess
from verl_core.config import (
    DataConfig,
    ModelConfig,
    QuantizationConfig,
    RewardConfig,
    SandboxConfig,
    SFTConfig,
    VerlFlowConfig,
    load_config,
    with_overrides,
)
from verl_core.data import adapters
from verl_core.data.prompt_stream import stream_rows
from verl_core.data.tokenizer import train_tokenizer
from verl_core.errors import ConfigError
from verl_core.runtime.run import RunContext, end_run
from verl_core.store.lease import acquire_run_lease, release_run_lease

# --------------------------------------------------------------------------------------------------
# data.*


def test_data_instruction_is_appended_to_every_prompt(tmp_path: Path) -> None:
    rows = [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(6)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(source="jsonl", train_files=[str(path)], val_holdout_rows=2, instruction="Be brief.")
    ctx = RunContext(run_id="instr", store_url=str(tmp_path / "store"))
    store = ctx.store()
    table = store.read_table(store.read_manifest(preprocess.fn(ctx, data)), "prompts/train.parquet")
    # question + " " + instruction, as verl's GSM8K preprocessing
    assert all(p[-1]["content"].endswith("?" + " Be brief.") for p in table.column("prompt").to_pylist())


def test_data_hf_name_and_splits_choose_what_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str | None, str]] = []

    def fake_read_hf(path: str, name: str | None, split: str) -> Any:
        calls.append((path, name, split))
        for i in range(4):
            yield adapters.RawRow(
                f"hf:{path}[{split}]", i + 1, {"question": f"{split} q{i}", "answer": str(i)}, "row"
            )

    monkeypatch.setattr(adapters, "read_hf", fake_read_hf)
    data = DataConfig(
        source="hf", train_files=["org/ds"], hf_name="cfg", hf_train_split="tr", hf_val_split="te"
    )
    preprocess.fn(RunContext(run_id="hf", store_url=str(tmp_path)), data)
    assert calls == [("org/ds", "cfg", "tr"), ("org/ds", "cfg", "te")]


def test_data_arithmetic_steps_sets_the_operations_per_problem(tmp_path: Path) -> None:
    data = DataConfig(arithmetic_train_size=8, arithmetic_val_size=4, arithmetic_steps=3)
    ctx = RunContext(run_id="steps", store_url=str(tmp_path))
    store = ctx.store()
    sft = store.read_table(store.read_manifest(preprocess.fn(ctx, data)), "sft/train.parquet")
    # a worked solution is one line per operation, then "#### answer": 3 + 1 lines
    assert {len(r.splitlines()) for r in sft.column("response").to_pylist()} == {4}


def test_data_shuffle_off_keeps_the_prompt_order() -> None:
    # without shuffle the stream is the identity permutation, epoch after epoch: rows 8, 9, then 0, 1
    assert stream_rows(10, 8, 4, seed=1, shuffle=DataConfig(shuffle=False).shuffle) == ([8, 9, 0, 1], 0)
    assert stream_rows(10, 0, 10, seed=1, shuffle=DataConfig().shuffle)[0] != list(range(10))


# --------------------------------------------------------------------------------------------------
# model.*, mixed precision, optimizers


def test_model_lora_dropout_reaches_the_adapter() -> None:
    tok = train_tokenizer([f"{i} + {i} = {2 * i}" for i in range(50)], 300)
    model = ModelConfig(hidden_size=32, intermediate_size=64, vocab_size=300, lora_rank=2, lora_dropout=0.25)
    policy = build_policy(model, tok, seed=0)
    assert policy.peft_config["default"].lora_dropout == 0.25


def test_model_vocab_pad_to_pads_the_trained_tokenizer(tmp_path: Path) -> None:
    from stages.floor.artifacts import load_tokenizer
    from stages.template_pack import template_pack

    data = DataConfig(arithmetic_train_size=20, arithmetic_val_size=4)
    toks, prompts = [], []
    for run_id, model in (("plain", ModelConfig()), ("padded", ModelConfig(vocab_pad_to=2048))):
        ctx = RunContext(run_id=run_id, store_url=str(tmp_path))
        store = ctx.store()
        uri = template_pack.fn(ctx, data, model, preprocess.fn(ctx, data))
        toks.append(load_tokenizer(store, uri))
        prompts.append(store.read_table(store.read_manifest(uri), "prompt_tokens/train.parquet"))
    # the trained vocabulary (at most model.vocab_size=512) padded to 2048 ids; the prompts' ids unchanged
    assert len(toks[0]) <= 512 and len(toks[1]) == 2048
    assert prompts[0].column("input_ids").to_pylist() == prompts[1].column("input_ids").to_pylist()


def test_model_quantization_double_quant_and_compute_dtype() -> None:
    q = QuantizationConfig(double_quant=False, compute_dtype="float16")
    spec = quant_spec(ModelConfig(lora_rank=8, quantization=q))
    assert spec is not None and spec.double_quant is False and spec.compute_dtype == "float16"


@pytest.mark.parametrize("section", ["actor", "critic", "ref"])
def test_mixed_precision_buffer_dtype(section: str) -> None:
    cfg = load_config(
        None,
        [
            f"{section}.mixed_precision.param_dtype=bfloat16",
            f"{section}.mixed_precision.buffer_dtype=bfloat16",
        ],
    )
    mp = mixed_precision(getattr(cfg, section).mixed_precision)
    assert mp is not None and mp.buffer_dtype == torch.bfloat16


def test_actor_warmup_steps_ratio_and_lr_scheduler() -> None:
    cfg = load_config(None, ["actor.warmup_steps_ratio=0.25", "actor.lr_scheduler=cosine"])
    # 10 iterations × 1 epoch × (8 prompts / 4 per mini-batch) = 20 steps, a quarter of them warm-up
    spec = actor_spec(cfg, 10)
    assert (spec.total_steps, spec.warmup_steps, spec.scheduler) == (20, 5, "cosine")


def test_sft_lr_scheduler() -> None:
    sft = SFTConfig(lr_scheduler="constant")
    spec = optim_spec(
        lr=sft.lr, weight_decay=sft.weight_decay, grad_clip=sft.grad_clip, total_steps=10,
        warmup_ratio=sft.warmup_ratio, scheduler=sft.lr_scheduler,
    )  # fmt: skip
    assert spec.scheduler == "constant"


def test_algorithm_gamma_and_grpo_std_normalisation_reach_the_update() -> None:
    cfg = load_config(None, ["algorithm.gamma=0.9", "algorithm.norm_adv_by_std_in_grpo=false"])
    spec = ppo_spec(cfg, 0)
    assert spec.gamma == 0.9 and spec.norm_adv_by_std_in_grpo is False


# --------------------------------------------------------------------------------------------------
# reward.*


def test_reward_code_score_and_code_workers() -> None:
    cfg = RewardConfig(scorers=["code"], code_score="all", code_workers=3)
    (scorer,) = build_scorers(cfg, SandboxConfig(allow_weak_sandbox=True))
    assert (scorer.scorer.mode, scorer.scorer.num_workers) == ("all", 3)


def test_reward_function_kwargs_reach_the_function_scorer(tmp_path: Path) -> None:
    # reward.function_kwargs: keywords bound to every call (the scorer's function is a partial of them)
    (tmp_path / "fn.py").write_text(
        "def f(data_source, solution_str, ground_truth, extra_info=None, *, weight):\n    return weight\n"
    )
    cfg = load_config(
        None,
        [
            f"reward.function={tmp_path / 'fn.py'}:f",
            "reward.scorers=[function]",
            "reward.function_kwargs={weight: 2}",
        ],
    )
    (scorer,) = build_scorers(cfg.reward, SandboxConfig())
    assert scorer.scorer.kwargs == {"weight": 2} and scorer.scorer.bound.keywords == {"weight": 2}


def test_reward_model_path_and_dtype_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"reward.model_path: required when reward.scorers has 'model'"):
        load_config(None, ["reward.scorers=[model]"])
    cfg = load_config(
        None, ["reward.scorers=[model]", "reward.model_path=org/rm", "reward.model_dtype=bfloat16"]
    )
    assert (cfg.reward.model_path, cfg.reward.model_dtype) == ("org/rm", "bfloat16")
    with pytest.raises(ConfigError, match=r"^reward.model_dtype: got 'float16'"):
        load_config(None, ["reward.model_dtype=float16"])


def test_reward_judge_base_url_is_an_http_url_without_a_trailing_slash() -> None:
    judge = load_config(None, ["reward.judge.base_url=http://judge:8000/v1/"]).reward.judge
    assert judge.base_url == "http://judge:8000/v1"
    with pytest.raises(ConfigError, match=r"^reward.judge.base_url: "):
        load_config(None, ["reward.judge.base_url=judge:8000"])


# --------------------------------------------------------------------------------------------------
# trainer, store, tracking, export, eval


def test_trainer_total_epochs_caps_the_planned_iterations() -> None:
    cfg = load_config(
        None, ["trainer.total_iterations=50", "trainer.total_epochs=2", "data.train_batch_size=8"]
    )
    # 2 passes over 20 prompts at 8 per iteration: ceil(2 × 20 / 8) = 5 iterations, under the 50 asked
    assert planned_iterations(cfg, 20) == 5
    assert planned_iterations(with_overrides(cfg, ["trainer.total_epochs=100"]), 20) == 50


def test_trainer_project_name_and_tracking_wandb_entity() -> None:
    cfg = load_config(
        None,
        ["tracking.backends=[wandb]", "trainer.project_name=proj", "tracking.wandb_entity=team"],
    )
    fields = wandb_fields(cfg, "memory://w", "r1")
    # no tracking.wandb_project: the W&B project is trainer.project_name
    assert (fields["wandb_project"], fields["wandb_entity"]) == ("proj", "team")


def test_store_lease_ttl_s_is_the_run_lease_ttl(tmp_path: Path) -> None:
    cfg = load_config(None, [f"store.url={tmp_path}", "store.lease_ttl_s=42", "tracking.enabled=false"])
    ctx = start_run(cfg, "leased")
    try:
        lease = acquire_run_lease(ctx.store(), ctx.run_id, 1.0)  # re-entrant: the run's own lease
        assert lease.ttl_s == 42.0
        release_run_lease(ctx.store_url, ctx.run_id)
    finally:
        end_run(ctx)


def test_export_registered_model_name_and_eval_table_rows() -> None:
    cfg = load_config(None, ["export.registered_model_name=my-model", "eval.table_rows=0"])
    assert (cfg.export.registered_model_name, cfg.eval.table_rows) == ("my-model", 0)  # 0: no table
    with pytest.raises(ConfigError, match=r"^eval.table_rows: got -1"):
        load_config(None, ["eval.table_rows=-1"])


# --------------------------------------------------------------------------------------------------
# execution.* (deployments)


def _fake_dispatch(monkeypatch: pytest.MonkeyPatch, verdicts: list[dispatch.Verdict]) -> list[str]:
    started: list[str] = []

    def start(deployment: str, parameters: dict[str, Any], field: str) -> Any:
        started.append(deployment)
        return SimpleNamespace(id=f"fr-{len(started)}", name=f"run-{len(started)}")

    monkeypatch.setattr(dispatch, "_start", start)
    monkeypatch.setattr(dispatch, "_supervise", lambda *a: (verdicts.pop(0), "crashed"))
    return started


def test_execution_sft_and_rl_deployments_name_what_is_dispatched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = _fake_dispatch(monkeypatch, [dispatch.Verdict.COMPLETED] * 2)
    cfg = with_overrides(
        VerlFlowConfig(), ["execution.sft_deployment=sft/pool-a", "execution.rl_deployment=rl/b"]
    )
    ctx = RunContext(run_id="d", store_url=str(tmp_path))
    dispatch.dispatch(ctx, cfg, "sft_deployment", {})
    dispatch.dispatch(ctx, cfg, "rl_deployment", {})
    assert started == ["sft/pool-a", "rl/b"]


def test_execution_redispatch_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = _fake_dispatch(monkeypatch, [dispatch.Verdict.CRASHED] * 3)
    execution = load_config(None, ["execution.redispatch_retries=1"]).execution
    with pytest.raises(
        dispatch.StageRunError, match=r"dispatched 2 times \(execution.redispatch_retries=1\)"
    ):
        dispatch.run_stage_deployment(
            "sft/gpu", {}, execution=execution, field="execution.sft_deployment", store=None, run_id="r"
        )  # type: ignore[arg-type]
    assert started == ["sft/gpu", "sft/gpu"]  # the first run and one retry


def test_execution_start_timeout_s_marks_a_never_started_run_lost() -> None:
    e = load_config(None, ["execution.start_timeout_s=30"]).execution
    watch = dispatch.Watch("fr", e.lost_after_s, e.start_timeout_s, e.redispatch_timeout_s)
    assert watch.observe(0.0, "PENDING", None, True) is dispatch.Verdict.WAIT  # claimed at t = 0
    assert watch.observe(30.0, "RUNNING", None, None) is dispatch.Verdict.WAIT  # 30 s: not yet over
    assert watch.observe(31.0, "RUNNING", None, None) is dispatch.Verdict.LOST  # no heartbeat after 31 s


def test_execution_api_outage_s_fails_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    import prefect.client.orchestration as orchestration

    class DownClient:
        def __enter__(self) -> DownClient:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def read_flow_run(self, flow_run_id: str) -> Any:
            raise ConnectionError("server gone")

    monkeypatch.setattr(orchestration, "get_client", lambda sync_client: DownClient())
    e = load_config(None, ["execution.api_outage_s=0.01", "execution.poll_interval_s=0.02"]).execution
    with pytest.raises(dispatch.StageRunError, match=r"has not answered for .* \(execution.api_outage_s\)"):
        dispatch._supervise("fr", "sft/gpu", e, None, "r")  # type: ignore[arg-type]
