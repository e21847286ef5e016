"""``verl-flow doctor --config CONFIG`` (the README's command: a config and no overrides) reports
/dev/shm against the weight syncs of the config's model; /dev/shm is faked as Docker's default."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from verl_core.rollout import weight_sync


def test_doctor_with_only_a_config_reports_shm_against_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weight_sync, "shm_space", lambda: (64 << 20, 64 << 20))  # Docker's default
    # hidden 1024, 4 layers, 8 heads (head_dim 128), 2 kv heads (256 wide), MLP 4096, vocab 512, tied:
    #   embed_tokens + lm_head 2 · 512·1024 = 1,048,576
    #   per layer q 1024·1024 + 1024 = 1,049,600, k and v 256·1024 + 256 = 262,400 each,
    #   o 1,048,576, MLP 3 · 1024·4096 = 12,582,912, norms 2,048: 15,207,936; 4 layers 60,831,744
    #   + final norm 1,024 = 61,881,344 fp32 parameters = 236 MiB (+ 1/16: 251 MiB) > 64 MiB
    model = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 8}
    config = {
        "rollout": {"name": "vllm"},
        "model": model,
        "store": {"url": str(tmp_path / "runs")},
        "tracking": {"enabled": False},
    }
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["doctor", "--config", str(path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    [row] = [line for line in result.stdout.splitlines() if line.startswith("│ /dev/shm ")]
    assert "│ warn " in row and "64 MiB free of 64 MiB" in row
    assert "≥ 251 MiB to stage 236 MiB of weights (rollout.name: 'vllm')" in row
    assert "--shm-size" in row and "--ipc=host" in row
