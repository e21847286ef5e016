"""Infra files that CI cannot run (no cluster, no GPU) still have to be well-formed: the Kubernetes
base job template uses only variables it declares and requests GPUs; prefect.yaml has the
deployments the README documents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_k8s_template_requests_gpus_with_declared_variables() -> None:
    template = json.loads((REPO / "infra/k8s/gpu-base-job-template.json").read_text())
    declared = set(template["variables"]["properties"])
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", json.dumps(template["job_configuration"])))
    assert used <= declared, used - declared
    container = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert template["variables"]["properties"]["gpus"]["default"] == 1


def test_prefect_yaml_deployments() -> None:
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    names = {
        (d["entrypoint"].rsplit(":", 1)[1], d["name"], d["work_pool"]["name"]) for d in spec["deployments"]
    }
    assert names == {
        ("rlhf_pipeline", "quickstart", "cpu"),
        ("rlhf_pipeline", "gsm8k-ppo", "cpu"),
        ("rlhf_pipeline", "nightly-retrain", "cpu"),
        ("rescore_flow", "rescore", "cpu"),
        ("replay_flow", "replay", "cpu"),
        ("rlhf_pipeline", "fork", "cpu"),
        ("sft_flow", "sft-stage", "gpu"),
        ("rl_loop", "rl-loop-stage", "gpu"),
        ("export_flow", "export-stage", "gpu"),
        ("serve_model", "serve-model", "gpu"),
    }
    for d in spec["deployments"]:
        config_file = d.get("parameters", {}).get("config_file")
        assert config_file is None or (REPO / config_file).is_file()
