"""Every deployed flow explains its parameters in the UI, and the serve-model deployment's empty
``store_url`` (a one-machine deploy) means the same local store as the other flows' (issue 39 item 4)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from prefect.utilities.callables import parameter_schema

import flows.serving
from verl_core.config import StoreConfig

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
ENTRYPOINTS = sorted({d["entrypoint"] for d in DEPLOYMENTS})


@pytest.mark.parametrize("entrypoint", ENTRYPOINTS)
def test_every_parameter_of_a_deployed_flow_has_a_description(entrypoint: str) -> None:
    # Prefect's Run form shows the docstring's "Args:" entry under each field (parameter_schema reads it)
    path, name = entrypoint.split(":")
    fn = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
    props = parameter_schema(fn.fn).model_dump()["properties"]
    assert props and [p for p, v in props.items() if not v.get("description")] == []


def test_serve_model_reads_the_default_store_when_store_url_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    class Stop(Exception):
        pass

    def resolve(target: str, store_url: str, workdir: str) -> None:
        asked.append(store_url)
        raise Stop

    monkeypatch.setattr(flows.serving, "resolve_model", resolve)
    for given, expected in (("", StoreConfig().url), ("s3://team/store", "s3://team/store")):
        with pytest.raises(Stop):
            flows.serving.serve_model.fn("run-1", given)
        assert asked.pop() == expected
