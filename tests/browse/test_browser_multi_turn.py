"""The rollout browser on a run trained with tool turns (tests/browse/multi_turn_run.py: multi-turn
GRPO, a calculator call in every model turn that stops), in headless Chromium: the samples grid's
tool-calls filter, the group view's turns (tool output distinguishable from the model's text), the
token view's tool tokens (loss mask 0: grey, no value, not coloured by advantage or mismatch), the
token texts (multi-byte characters whole: the spans concatenate to the response's decode), and the
runs page's MLflow and Prefect columns. Each checked against the run's files read directly."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flows.run_links import read_links
from tests.browse.conftest import REPO
from tests.browse.multi_turn_run import GROUP_SIZE, RUN
from tests.browse.test_browser import CHROMIUM, Browser, _table, chromium_page, serve
from verl_core.store import ArtifactStore

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (make chromium installs it as root)"
)
KEY = "iter-0000"
TOOL_GREY = "rgb(229, 231, 235)"  # .tok.tool's background (#e5e7eb)


@pytest.fixture(scope="module")
def tools_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The multi-turn run's store, made once (~45 s on 2 cores); ``VERL_FLOW_BROWSE_TOOLS_STORE=DIR``:
    a store an earlier session made (made there when it has no run yet)."""
    from filelock import FileLock

    kept = os.environ.get("VERL_FLOW_BROWSE_TOOLS_STORE")
    if kept:
        store = Path(kept)
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        store = tmp_path_factory.getbasetemp().parent / "browse-tools-store"
    else:
        store = tmp_path_factory.mktemp("browse-tools-store")
    with FileLock(str(store) + ".lock"):
        if not (store / "runs" / RUN / "report" / "manifest.json").is_file():
            env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90"}
            proc = subprocess.run(
                [sys.executable, "-m", "tests.browse.multi_turn_run", str(store)],
                cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return str(store)


@pytest.fixture(scope="module")
def browser(tools_store: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    state, shots = tmp_path_factory.mktemp("state"), tmp_path_factory.mktemp("screenshots")
    with serve(tools_store, RUN, state) as base, chromium_page(base, shots) as b:
        yield b


def _rollouts(tools_store: str) -> list[dict[str, Any]]:
    return _table(ArtifactStore(tools_store), RUN, f"{KEY}/rollout", "rollouts.parquet")


def _tool_sample(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    """The first sample with a tool turn (the fixture makes some: see its docstring)."""
    return next(r for r in rollouts if any(t["role"] == "tool" for t in r["turns"]))


def _sid(r: dict[str, Any]) -> str:
    return f"{r['group_id']}:{r['sample_index']}"


def test_tool_calls_filter(browser: Browser, tools_store: str) -> None:
    rollouts = _rollouts(tools_store)
    with_calls = {_sid(r) for r in rollouts if any(t["calls"] for t in r["turns"])}
    assert 0 < len(with_calls) < len(rollouts)  # some samples called the tool, some did not
    page = browser.page
    browser.open(f"/run/{RUN}/samples?kind=train&key={KEY}", "#samples-grid .ag-row")
    for choice, expected in (("yes", with_calls), ("no", {_sid(r) for r in rollouts} - with_calls)):
        page.locator("#f-tools label", has_text=choice).click()
        page.wait_for_function(
            f"document.querySelector('#samples-total').innerText === '{len(expected)} matching samples'"
        )
        browser.rows("samples-grid", len(expected))
        cells = page.locator('#samples-grid .ag-center-cols-container [col-id="sample_id"]')
        assert set(cells.all_inner_texts()) == expected
        tools = page.locator(
            '#samples-grid .ag-center-cols-container [col-id="tool_calls"]'
        ).all_inner_texts()
        assert all((int(t) > 0) == (choice == "yes") for t in tools)
        if choice == "yes":
            browser.shot("tools-samples")


def test_group_view_shows_the_turns(browser: Browser, tools_store: str) -> None:
    rollouts = _rollouts(tools_store)
    r = _tool_sample(rollouts)
    browser.open(f"/run/{RUN}/group?kind=train&key={KEY}&prompt={r['prompt_index']}", "#group-responses")
    cards = browser.page.locator("#group-responses .group-response")
    assert cards.count() == GROUP_SIZE
    card = browser.page.locator(f'#group-responses .group-response[data-sample-id="{_sid(r)}"]')
    turns = card.locator(".turn")
    assert turns.evaluate_all("els => els.map(e => e.dataset.role)") == [t["role"] for t in r["turns"]]
    for i, t in enumerate(r["turns"]):
        shown = turns.nth(i)
        assert shown.locator("pre").text_content() == t["text"]
        if t["role"] == "tool":  # grey, with the call it answers and its result
            assert "turn-tool" in (shown.get_attribute("class") or "")
            call = t["calls"][0]
            assert f"{call['name']}(" in shown.inner_text() and call["result"] in shown.inner_text()
            bg = shown.locator("pre").evaluate("e => getComputedStyle(e).backgroundColor")
            assert bg == TOOL_GREY
    assert card.locator(".fact-tools").inner_text() == str(sum(len(t["calls"]) for t in r["turns"]))
    # a single-turn sample of the group shows its text, no turns
    single = next(x for x in rollouts if x["prompt_index"] == r["prompt_index"] and len(x["turns"]) < 2)
    assert browser.page.locator(f'.group-response[data-sample-id="{_sid(single)}"] .turn').count() == 0
    browser.shot("tools-group")
    # the prompt across iterations (one here) shows the same turns
    mine = [x for x in rollouts if x["prompt_index"] == r["prompt_index"]]
    browser.open(f"/run/{RUN}/prompt?prompt={r['prompt_index']}", "#prompt-history")
    tool_turns = sum(t["role"] == "tool" for x in mine for t in x["turns"])
    assert browser.page.locator("#prompt-history .turn-tool").count() == tool_turns > 0


def test_token_view_marks_tool_tokens_and_keeps_characters_whole(browser: Browser, tools_store: str) -> None:
    from tokenizers import Tokenizer

    store = ArtifactStore(tools_store)
    r = _tool_sample(_rollouts(tools_store))
    u = next(x for x in _table(store, RUN, f"{KEY}/update", "update.parquet") if _sid(x) == _sid(r))
    mask = r["loss_mask"]
    assert 0 in mask and 1 in mask
    tp = store.committed(RUN, "template_pack")
    assert tp is not None
    tok = Tokenizer.from_str(store.read_bytes(tp, "tokenizer/tokenizer.json").decode())
    browser.open(f"/run/{RUN}/tokens?kind=train&key={KEY}&sample={_sid(r)}", "#tokens-view .tok")
    spans = browser.page.locator("#tokens-view .tok")
    assert spans.count() == len(r["response_ids"])  # one span per token, tool tokens included

    def attrs() -> list[dict[str, str]]:
        return spans.evaluate_all(
            "els => els.map(e => ({value: e.dataset.value, tool: e.dataset.tool, text: e.textContent,"
            " bg: getComputedStyle(e).backgroundColor}))"
        )

    shown = attrs()
    assert [a["tool"] == "true" for a in shown] == [m == 0 for m in mask]
    # the spans' texts are the response's decode: no replacement character where it has none
    assert "".join(a["text"] for a in shown) == tok.decode(r["response_ids"], skip_special_tokens=False)
    for a, m, adv in zip(shown, mask, u["advantages"], strict=True):
        if m == 0:  # tool output: no value, the tool grey, whatever the advantage column holds
            assert a["value"] == "" and a["bg"] == TOOL_GREY
        else:
            assert float(a["value"]) == pytest.approx(adv, abs=1e-6)
    browser.shot("tools-tokens")
    browser.page.locator("#tokens-colour label", has_text="mismatch").click()
    expected = [b - t for b, t, m in zip(r["logprobs"], u["old_log_probs"], mask, strict=True) if m]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        shown = attrs()
        model = [float(a["value"]) for a in shown if a["tool"] == "false"]
        if model == pytest.approx(expected, abs=1e-6):
            break
        time.sleep(0.2)
    assert model == pytest.approx(expected, abs=1e-6)
    assert all(a["value"] == "" and a["bg"] == TOOL_GREY for a in shown if a["tool"] == "true")


def test_runs_page_shows_the_mlflow_run_and_the_flow_run(browser: Browser, tools_store: str) -> None:
    from mlflow.tracking import MlflowClient

    from verl_core.runtime.tracking import RUN_ID_TAG

    links = read_links(ArtifactStore(tools_store), RUN)
    mlflow, prefect = links["mlflow"], links["prefect"]
    assert mlflow is not None and prefect is not None
    # the MLflow run the tracker tagged with the run's id; a SQLite database: no UI URL
    uri = f"sqlite:///{Path(tools_store).resolve()}/mlflow.db"
    assert mlflow["tracking_uri"] == uri and mlflow["ui_url"] is None
    found = MlflowClient(tracking_uri=uri).search_runs(
        [mlflow["experiment_id"]], filter_string=f"tags.`{RUN_ID_TAG}` = '{RUN}'"
    )
    assert [f.info.run_id for f in found] == [mlflow["run_id"]]
    browser.open("/", "#runs-table")
    row = browser.page.locator(f'#runs-table tr[data-run-id="{RUN}"]')
    cell = row.locator("td").nth(10)
    assert cell.locator(".mlflow-run-id").inner_text() == mlflow["run_id"]
    assert cell.locator(".mlflow-ui").inner_text() == f"mlflow ui --backend-store-uri {uri}"
    assert cell.locator("a").count() == 0  # no dead link
    flow = row.locator("td").nth(11)  # a temporary Prefect server: the flow run's name and id, no link
    assert prefect["flow_run_name"] in flow.inner_text() and prefect["flow_run_id"] in flow.inner_text()
    assert flow.locator("a").count() == 0
    browser.shot("tools-runs")
