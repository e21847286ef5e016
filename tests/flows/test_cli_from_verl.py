"""`verl-flow from-verl`: verl launch scripts (tests/flows/data/*.sh, written in verl's style for this
test) read, converted to a config, and the PPO and GRPO ones run at tiny size through `verl-flow run`."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.cli.from_verl import convert, parse_launch
from verl_core.config import load_config
from verl_core.store import ArtifactStore, get_schema

DATA = Path(__file__).resolve().parent / "data"


def _verl_parquet(path: Path, rows: int, split: str) -> None:
    """Prompts in verl's schema (as its GSM8K preprocessing writes them): a + b problems, distinct
    between the splits."""
    first = 0 if split == "train" else 1000
    table = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i // 10} + {i % 10}? Answer after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i // 10 + i % 10)},
            "extra_info": {"split": split, "index": i, "answer": f"#### {i // 10 + i % 10}", "question": "q"},
        }
        for i in range(first, first + rows)
    ]
    pq.write_table(pa.Table.from_pylist(table, schema=get_schema("prompts")), path)


def test_script_is_read_with_continuations_variables_and_skips() -> None:
    text = (
        'set -x\nexport ROOT=/d\nN=${STEPS:-4}\nENGINE="hf"  # or vllm\n'
        "CUDA_VISIBLE_DEVICES=0 python3 -m verl.trainer.main_ppo \\\n"
        "    data.train_files=$ROOT/train.parquet \\\n"
        "    trainer.total_training_steps=$N \\\n"
        "    trainer.experiment_name='exp one' \\\n"
        "    +actor_rollout_ref.actor.optim.lr=1e-6 \\\n"
        "    actor_rollout_ref.rollout.name=$ENGINE \\\n"
        "    data.val_files=$MISSING/x.parquet $@\n"
    )
    launch = parse_launch(text, environ={})
    assert launch.overrides == [
        ("data.train_files", "/d/train.parquet"),
        ("trainer.total_training_steps", "4"),  # ${STEPS:-4}: the default
        ("trainer.experiment_name", "exp one"),  # shell quoting removed
        ("actor_rollout_ref.actor.optim.lr", "1e-6"),  # Hydra's + (append) dropped
        ("actor_rollout_ref.rollout.name", "hf"),  # an assignment with a comment after it
        ("data.val_files", "$MISSING/x.parquet"),  # unset: kept as written, and said
    ]
    said = " | ".join(launch.skipped)
    assert "set -x" in said and "$MISSING" in said and "$@" in said
    assert "CUDA_VISIBLE_DEVICES=0" in said  # an env prefix of the command is a word, not an override
    # bare overrides (stdin): the same pairs
    assert parse_launch("trainer.nnodes=1 critic.optim.lr=2e-5\n", environ={}).overrides == [
        ("trainer.nnodes", "1"),
        ("critic.optim.lr", "2e-5"),
    ]


def test_ppo_script_converts_with_a_row_per_key(tmp_path: Path) -> None:
    _verl_parquet(tmp_path / "train.parquet", 600, "train")
    launch = parse_launch((DATA / "verl_ppo_critic.sh").read_text(), environ={"DATA": str(tmp_path)})
    out = convert(launch)
    s = out.settings
    assert s["algorithm"]["adv_estimator"] == "gae" and s["critic"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert s["model"] == {
        "path": "Qwen/Qwen2.5-0.5B-Instruct",
        "init": "pretrained",
        "gradient_checkpointing": True,
    }
    assert s["actor"]["lr"] == 1e-6 and s["critic"]["lr"] == 1e-5
    # a micro-batch count alone means verl's fixed micro-batches: token budgets off
    assert s["actor"]["ppo_micro_batch_size_per_gpu"] == 8 and s["actor"]["use_dynamic_bsz"] is False
    assert s["data"]["truncation"] == "drop"  # filter_overlong_prompts wins over truncation='error'
    assert s["tracking"] == {"enabled": True, "backends": ["mlflow"]}
    assert s["trainer"]["save_freq"] == 0  # verl's -1
    assert s["sft"] == {"enable": False} and s["data"]["source"] == "parquet"
    # verl's length: 3 epochs × (600 rows // 256 per batch = 2 batches, the partial one dropped) = 6
    assert s["trainer"]["total_iterations"] == 6 and s["trainer"]["total_epochs"] == 3
    became = {r.verl_key: r.became for r in out.rows}
    assert became["critic.ppo_micro_batch_size_per_gpu"].startswith("dropped:")
    assert "critic.ppo_max_token_len_per_gpu" in became["critic.ppo_micro_batch_size_per_gpu"]
    assert (
        "rollout.log_prob_max_token_len_per_gpu"
        in became["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"]
    )
    assert "verl's default" in became["actor_rollout_ref.rollout.n"]  # verl samples 1 unless told
    assert s["rollout"]["n"] == 1


def test_grpo_and_lora_scripts_convert(tmp_path: Path) -> None:
    grpo = convert(parse_launch((DATA / "verl_grpo.sh").read_text(), environ={"HOME": "/h"})).settings
    assert grpo["algorithm"]["adv_estimator"] == "grpo" and "path" not in grpo.get("critic", {})
    assert grpo["actor"]["use_kl_loss"] is True and grpo["actor"]["warmup_steps_ratio"] == 0.1
    assert grpo["trainer"]["total_iterations"] == 40  # total_training_steps
    assert grpo["data"]["train_files"] == ["/h/data/gsm8k/train.parquet"]
    assert grpo["tracking"] == {"enabled": False}  # logger=console only
    _verl_parquet(tmp_path / "train.parquet", 40, "train")
    lora = convert(parse_launch((DATA / "verl_grpo_lora.sh").read_text(), environ={"ROOT": str(tmp_path)}))
    s = lora.settings
    assert s["model"]["lora_rank"] == 32 and s["model"]["lora_alpha"] == 16
    assert s["reward"] == {"function": f"{tmp_path}/my_reward.py:my_score", "scorers": ["function"]}
    assert "ref" not in s or "param_offload" not in s["ref"]  # under LoRA the reference is the base
    assert s["trainer"]["total_iterations"] == 2 * (40 // 16)
    assert s["tracking"] == {"enabled": True, "backends": ["wandb"]}


def _converted_runs(tmp_path: Path, script: str, monkeypatch: pytest.MonkeyPatch, extra: list[str]) -> None:
    """``from-verl SCRIPT -o`` then ``run`` the YAML with the data, the model and sizes made tiny."""
    monkeypatch.setenv("DATA", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True)
    for d in (tmp_path, data):
        _verl_parquet(d / "train.parquet", 16, "train")
        _verl_parquet(d / "test.parquet", 4, "test")
    out = tmp_path / "converted.yaml"
    runner = CliRunner()
    converted = runner.invoke(app, ["from-verl", str(DATA / script), "-o", str(out)])
    assert out.is_file(), converted.output
    tiny = [
        f"store.url={tmp_path / 'store'}",
        "model.init=scratch",
        "model.path=null",
        "rollout.name=hf",
        "trainer.n_gpus_per_node=1",
        "tracking.enabled=false",
        "data.train_batch_size=4",
        "data.max_prompt_length=48",
        "data.max_response_length=8",
        "actor.ppo_mini_batch_size=2",
        "rollout.n=2",
        "trainer.total_iterations=1",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "export.enable=false",
        "eval.enable=false",
        *extra,
    ]
    result = runner.invoke(app, ["run", str(out), *tiny, "--run-id", "fromverl"])
    assert result.exit_code == 0, result.output
    store = ArtifactStore(str(tmp_path / "store"))
    stages = {m.stage for m in store.list_manifests("fromverl")}
    assert {"iter-0000/rollout", "iter-0000/reward", "iter-0000/update"} <= stages
    assert "sft" not in stages  # verl's PPO trainer has no SFT warm-up


def test_converted_verl_ppo_runs_at_tiny_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _converted_runs(
        tmp_path, "verl_ppo_critic.sh", monkeypatch, ["critic.path=null", "critic.ppo_mini_batch_size=2"]
    )
    tiny = ["critic.path=null", "model.init=scratch", "model.path=null", "trainer.total_iterations=1"]
    assert load_config(tmp_path / "converted.yaml", tiny).use_critic  # gae: the run trained a critic


def test_converted_verl_grpo_runs_at_tiny_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _converted_runs(tmp_path, "verl_grpo.sh", monkeypatch, [])


def test_written_yaml_is_settings_only(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["from-verl", "-"], input="actor_rollout_ref.rollout.n=3 trainer.total_training_steps=2\n"
    )
    assert result.exit_code == 0, result.output
    body = result.stdout.split("┏")[0] if "┏" in result.stdout else result.stdout
    settings = yaml.safe_load(body)
    assert settings["rollout"]["n"] == 3 and settings["trainer"]["total_iterations"] == 2
