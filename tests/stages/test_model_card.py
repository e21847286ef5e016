"""The model card's front matter and facts for a pretrained base and hub data (no export needed)."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard

from stages.floor.model_card import CardFacts, base_license, render_card
from verl_core.config import load_config

FACTS = CardFacts(
    run_id="r1",
    config_hash="c" * 64,
    source_stage="ckpt/iter-0003",
    iteration=3,
    lineage={"data": "file:///s/runs/r1/preprocess/manifest.json", "policy": "p", "export": "e"},
    hashes={"data": "d" * 64, "policy": "f" * 64},
    rows={"train": 7473, "val": 1319},
)
SAMPLING = {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0, "top_k": -1}


def test_a_local_base_with_its_own_card_gives_the_licence(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n\n# base\n")
    assert base_license(str(base)) == "apache-2.0"
    assert base_license(str(tmp_path)) is None  # a directory without a card
    assert base_license("Qwen/Qwen2.5-0.5B-Instruct") is None  # a hub id whose card is not cached here

    cfg = load_config(None, ["model.init=pretrained", f"model.path={base}", "data.source=gsm8k"])
    card = ModelCard(str(render_card(cfg, FACTS, SAMPLING)))
    assert card.data.license == "apache-2.0"
    assert card.data.base_model is None  # a local directory is no hub id; the text names it
    assert f"`{base}` (a local directory)" in card.text
    assert card.data.datasets == ["openai/gsm8k"] and "data licence: MIT" in card.text
    assert "rows after cleaning: train 7473, val 1319" in card.text
    assert "greedy, at most 256 new tokens" in card.text  # rollout.temperature 0 in SAMPLING
    assert "Not registered" in card.text


def test_a_champion_in_a_team_store_gives_its_copys_licence(tmp_path: Path, monkeypatch) -> None:
    """Deployments mode on S3: model.path is the champion export's store URI; the card reads the
    licence from this process's copy of it (fetched at the flow's entry), and says nothing (no error)
    when this process holds no copy."""
    import stages.floor.model_card as model_card
    from verl_core.errors import ConfigError

    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "README.md").write_text("---\nlicense: mit\n---\n")
    uri = "s3://team/runs/r/export/manifest.json"
    monkeypatch.setattr(model_card, "model_dir", lambda path: str(copy) if path == uri else path)
    assert base_license(uri) == "mit"

    def not_fetched(path: str) -> str:
        raise ConfigError(f"model.path {path}: not fetched")

    monkeypatch.setattr(model_card, "model_dir", not_fetched)
    assert base_license(uri) is None


def test_a_hub_base_is_the_cards_base_model() -> None:
    cfg = load_config(None, ["model.init=pretrained", "model.path=Qwen/Qwen2.5-0.5B-Instruct"])
    mlflow = {
        "tracking_uri": "sqlite:///m.db",
        "run_id": "abc",
        "logged_model": "m-1",
        "name": "n",
        "version": "4",
    }
    card = ModelCard(str(render_card(cfg, CardFacts(**{**FACTS.__dict__, "mlflow": mlflow}), SAMPLING)))
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "registered model `n`, version 4" in card.text and 'load_model("models:/n/4")' in card.text
