"""Prefect's own UI, in headless Chromium (Debian's, driven by Playwright), on a Prefect server on
127.0.0.1 that serves it at ``/``: the quickstart deployment's Run form describes each parameter (the
flow's docstring ``Args:``), and a finished run's page leads to its summary artifact, which shows the
eval accuracy and the plots as images the browser loads (``data:`` PNGs, :mod:`flows.prefect_artifacts`),
and to its eval-samples table, which shows the prompts without the chat template and no sample text
turned into markdown headings. Without Chromium, the same run still checks that the pipeline flow
run's own log (what ``prefect deployment run --watch`` follows) carries its subflows' progress lines.

The run is the reliability suite's tiny pipeline (``tests/reliability/tiny.yaml``), made by
``verl-flow run`` on the test's server in a subprocess that also registers the deployment. Screenshots
of every page go to the test's tmp dir, and also to ``$VERL_FLOW_SCREENSHOTS`` when set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.prefect_server import prefect_server
from verl_core.store import ArtifactStore

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ARGS += ["--disable-component-update", "--disable-sync", "--no-first-run"]
needs_chromium = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (make chromium installs it as root)"
)
RUN = "ui"
PLOTS = 5  # stages/report.py: reward_accuracy, kl, entropy, response_length, timing
# The deployment as prefect.yaml's quickstart (its parameters and the flow's schema), then the run
MAKE = f"""
import sys
from flows.cli import app
from flows.pipeline import rlhf_pipeline
rlhf_pipeline.to_deployment(
    name="quickstart", parameters={{"config_file": "configs/quickstart.yaml", "overrides": []}}
).apply()
app(["run", "tests/reliability/tiny.yaml", f"store.url={{sys.argv[1]}}", "--run-id", "{RUN}"],
    standalone_mode=False)
"""


def _get(api: str, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{api}{path}", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """A Prefect server with the quickstart deployment and a finished tiny run; (ui base URL, API URL,
    store directory)."""
    tmp = tmp_path_factory.mktemp("prefect-ui")
    # the server serves Prefect's UI at /; the run's loggers send INFO lines to the API (server_env)
    with prefect_server(tmp, extra={"PREFECT_UI_ENABLED": "true"}) as (env, _, api):
        store = tmp / "store"
        out = subprocess.run(
            [sys.executable, "-c", MAKE, str(store)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
        yield api.removesuffix("/api"), api, store


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Any]:
    """A Chromium page; every ``page.shot(name)`` is a full-page screenshot kept after the test."""
    from playwright.sync_api import sync_playwright

    dirs = [
        tmp_path,
        *([Path(os.environ["VERL_FLOW_SCREENSHOTS"])] if "VERL_FLOW_SCREENSHOTS" in os.environ else []),
    ]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        p = browser.new_page(viewport={"width": 1400, "height": 1000})

        def shot(name: str) -> None:
            path = tmp_path / f"prefect-ui-{name}.png"
            p.screenshot(path=str(path), full_page=True)
            for d in dirs[1:]:
                d.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, d / path.name)

        p.shot = shot
        try:
            yield p
        finally:
            browser.close()


@needs_chromium
def test_the_ui_describes_parameters_and_shows_the_run_summary(
    finished: tuple[str, str, Path], page: Any
) -> None:
    t0 = time.monotonic()
    ui, api, store_dir = finished
    [deployment] = _get(api, "/deployments/filter", {})
    schema = deployment["parameter_openapi_schema"]["properties"]
    described = {name: schema[name]["description"] for name in ("config_file", "overrides", "run_id")}
    assert all(described.values()), described

    # the deployment's Run form ("Custom run"): each field with the flow's description of it
    page.goto(f"{ui}/deployments/deployment/{deployment['id']}/run")
    page.get_by_text(described["config_file"], exact=False).first.wait_for(timeout=30_000)
    shown = " ".join(page.inner_text("body").split())
    for name, description in described.items():  # rendered as markdown: ``code`` loses its backticks
        assert " ".join(description.replace("`", "").split()) in shown, (name, description)
    page.shot("run-form")

    # the finished run's page → Artifacts → the summary
    [flow_run] = _get(api, "/flow_runs/filter", {"flows": {"name": {"any_": ["rlhf-pipeline"]}}})
    assert flow_run["state_type"] == "COMPLETED"
    page.goto(f"{ui}/runs/flow-run/{flow_run['id']}")
    page.get_by_text("Artifacts", exact=True).first.click()  # the run page's tab
    page.get_by_text("rlhf-run-summary", exact=True).first.wait_for(timeout=30_000)
    page.shot("flow-run-artifacts")
    page.get_by_text("rlhf-run-summary", exact=True).first.click()
    page.wait_for_url("**/artifacts/artifact/**", timeout=30_000)
    page.get_by_text("per-iteration metrics").first.wait_for(timeout=30_000)
    store = ArtifactStore(str(store_dir))
    [ev] = [m for m in store.list_manifests(RUN) if m.stage.startswith("eval/")]
    summary = page.inner_text("body")
    assert f"accuracy {ev.summary['accuracy']:.3f}" in summary, summary[:2000]
    assert "runs/runs/" not in summary and "file://" not in summary.replace(f"file://{store_dir}", "")
    page.wait_for_function(
        "n => [...document.images].filter(i => i.src.startsWith('data:image/png') && i.complete).length >= n",
        arg=PLOTS,
        timeout=30_000,
    )
    widths = page.evaluate(
        "[...document.images].filter(i => i.src.startsWith('data:image/png')).map(i => i.naturalWidth)"
    )
    assert len(widths) == PLOTS and min(widths) > 0, widths
    page.shot("summary")

    # the eval samples: the user's question, not the chat template; no response text as a heading
    [samples] = _get(api, "/artifacts/filter", {"artifacts": {"key": {"any_": ["eval-samples"]}}})
    page.goto(f"{ui}/artifacts/artifact/{samples['id']}")
    page.locator("table td").first.wait_for(timeout=30_000)
    table = page.inner_text("table")
    assert "<|im_start|>" not in table and "im_start" not in table, table[:1000]
    # the arithmetic data keep each prompt's user message as extra_info.question
    first = store.read_table(ev, "greedy/rollouts.parquet").slice(0, 1).to_pylist()[0]
    assert "<|im_start|>" in first["prompt_text"]  # the rollouts hold the templated prompt
    assert first["extra_info"]["question"] in table, table[:1000]
    assert page.locator("table td :is(h1, h2, h3, h4, h5, h6)").count() == 0
    # a response's lines do not stack up: every row about one line of text tall (was ~350 px)
    heights = page.evaluate("[...document.querySelectorAll('table tbody tr')].map(r => r.offsetHeight)")
    assert heights and max(heights) < 120, heights
    page.shot("eval-samples")
    assert time.monotonic() - t0 < 60  # the pages themselves; the server and the run are the fixture's


def test_the_pipeline_log_carries_the_subflows_progress(finished: tuple[str, str, Path]) -> None:
    """SFT and the RL loop are subflows (flow runs of their own): their progress lines are copied
    into the pipeline flow run's log (:mod:`flows.progress`), the one ``--watch`` and the UI follow."""
    _, api, _ = finished
    [flow_run] = _get(api, "/flow_runs/filter", {"flows": {"name": {"any_": ["rlhf-pipeline"]}}})
    logs = _get(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run["id"]]}}, "limit": 200})
    messages = [log["message"] for log in logs]
    # tiny.yaml: 2 SFT steps, 2 RL iterations; the first stage line of the loop always comes
    assert any(m.startswith("sft: step 2/2") for m in messages), messages
    assert "rl: iteration 1/2: rollout" in messages, messages
    assert any(m.startswith("rl: iteration 2/2 done") for m in messages), messages
