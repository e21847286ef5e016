"""``verl-flow browse`` in a real browser: the command serves the fixture's finished run
(tests/browse/conftest.py) and headless Chromium (Debian's, driven by Playwright) reads each view;
what a page shows is checked against the run's Parquet files read directly with pyarrow.

Screenshots of every view go to the test's tmp dir, and also to ``$VERL_FLOW_SCREENSHOTS`` when set
(docs/images/browse-samples.png is the samples view from such a run). A run with tool turns is
tests/browse/test_browser_multi_turn.py's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from browse.record import browser_url
from flows.run_links import read_links
from tests.browse.conftest import GROUP_SIZE, REPO, BrowseRun
from verl_core.store import ArtifactStore

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
ARGS += ["--disable-component-update", "--disable-sync", "--no-first-run"]
pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (make chromium installs it as root)"
)
KEY = "iter-0000"  # the training set the views are checked on


def _table(store: ArtifactStore, run_id: str, stage: str, name: str) -> list[dict[str, Any]]:
    """A committed Parquet file of ``stage``, read with pyarrow (not through the browser's queries)."""
    m = store.committed(run_id, stage)
    assert m is not None, stage
    return pq.read_table(store.file_uri(m, name).removeprefix("file://")).to_pylist()


class Browser:
    """The served app and a Chromium page on it; ``shot(name)`` saves a full-page screenshot."""

    def __init__(self, base: str, page: Any, shots: list[Path]) -> None:
        self.base, self.page, self.shots = base, page, shots

    def open(self, path: str, ready: str) -> None:
        self.page.goto(self.base + path)
        self.page.wait_for_selector(ready, timeout=30_000)

    def rows(self, grid: str, n: int) -> Any:
        """The rows of AG Grid ``grid`` once it shows ``n`` of them."""
        selector = f"#{grid} .ag-center-cols-container .ag-row"
        self.page.wait_for_function(f"document.querySelectorAll('{selector}').length === {n}")
        return self.page.locator(selector)

    def shot(self, name: str) -> None:
        for folder in self.shots:
            folder.mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(folder / f"{name}.png"), full_page=True)


@contextmanager
def serve(store_url: str, run_id: str, state: Path) -> Iterator[str]:
    """``verl-flow browse RUN`` on a free port, its record under ``state``: yields the base URL; stopped
    with SIGTERM, which must exit 0 and remove the browser's record."""
    cmd = [sys.executable, "-m", "flows.cli", "browse", run_id, "--store", store_url]
    env = {**os.environ, "XDG_STATE_HOME": str(state)}
    proc = subprocess.Popen(
        [*cmd, "--port", "0"],  # a free port: the printed URL says which
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen = ""  # up to "browsing STORE at URL  (Ctrl-C stops)", printed once it listens
    while not (found := re.search(rf"http://localhost:(\d+)/run/{run_id}\b", seen)):
        line = proc.stdout.readline()
        assert line, seen  # it exited
        seen += line
    port = int(found.group(1))
    records = list((state / "verl-flow" / "browsers").glob("*.json"))
    assert len(records) == 1  # what a pipeline run on this store reads (browse.record)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert not records[0].exists()


@contextmanager
def chromium_page(base: str, shots_dir: Path) -> Iterator[Browser]:
    """Headless Chromium on ``base``; screenshots to ``shots_dir`` and ``$VERL_FLOW_SCREENSHOTS``."""
    from playwright.sync_api import sync_playwright

    shots = [shots_dir]
    if os.environ.get("VERL_FLOW_SCREENSHOTS"):
        shots.append(Path(os.environ["VERL_FLOW_SCREENSHOTS"]))
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        page = chromium.new_page(viewport={"width": 1400, "height": 900})
        yield Browser(base, page, shots)
        chromium.close()


@pytest.fixture(scope="module")
def served(browse_run: BrowseRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``verl-flow browse RUN`` of the fixture's run: ``(base URL, state dir)``."""
    state = tmp_path_factory.mktemp("state")
    with serve(browse_run.store_url, browse_run.run_id, state) as base:
        yield base, state


@pytest.fixture(scope="module")
def browser(served: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    with chromium_page(served[0], tmp_path_factory.mktemp("screenshots")) as b:
        yield b


def test_runs_page_lists_the_run(browser: Browser, browse_run: BrowseRun) -> None:
    browser.open("/", "#runs-table")
    row = browser.page.locator(f'#runs-table tr[data-run-id="{browse_run.run_id}"]')
    assert row.count() == 1
    assert "finished" in row.inner_text()
    # the pipeline's flow run, as the run recorded it (a temporary Prefect server: its id, no link);
    # tracking is off in this run: no MLflow run
    links = read_links(ArtifactStore(browse_run.store_url), browse_run.run_id)
    assert links["prefect"] is not None and links["prefect"]["ui_url"] is None and links["mlflow"] is None
    assert links["prefect"]["flow_run_id"] in row.locator("td").nth(11).inner_text()
    assert row.locator("td").nth(10).inner_text() == "–"
    browser.shot("runs")
    browser.open(f"/run/{browse_run.run_id}", "#iteration-charts .js-plotly-plot")
    assert browser.page.locator("#iteration-charts .js-plotly-plot").count() == 4
    browser.shot("iterations")


def test_the_run_finds_the_browser_and_a_chart_point_opens_its_samples(
    browser: Browser, served: tuple[str, Path], browse_run: BrowseRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(served[1]))  # where the served browser wrote its record
    page_url = browser_url(ArtifactStore(browse_run.store_url).url, browse_run.run_id)
    assert page_url == f"{served[0]}/run/{browse_run.run_id}"  # the run's Prefect link artifact
    browser.page.goto(page_url)
    browser.page.wait_for_selector("#iteration-charts .js-plotly-plot .scatterlayer .point")
    # iteration 0 of the reward chart (the first chart, its first trace, its first point)
    point = (
        browser.page.locator("#iteration-charts .js-plotly-plot").first.locator(".scatterlayer .point").first
    )
    box = point.bounding_box()
    assert box is not None
    browser.page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    browser.page.wait_for_url(f"**/run/{browse_run.run_id}/samples?kind=train&key=iter-0000", timeout=15_000)
    browser.page.wait_for_selector("#samples-grid .ag-row")


def test_filter_to_incorrect_samples(browser: Browser, browse_run: BrowseRun) -> None:
    store = ArtifactStore(browse_run.store_url)
    rewards = _table(store, browse_run.run_id, f"{KEY}/reward", "rewards.parquet")
    wrong = {f"{r['group_id']}:{r['sample_index']}" for r in rewards if not r["correct"]}
    assert 0 < len(wrong) < len(rewards)  # half_credit: some correct, some not
    page = browser.page
    browser.open(f"/run/{browse_run.run_id}/samples?kind=train&key={KEY}", "#samples-grid .ag-row")
    page.wait_for_function(
        f"document.querySelector('#samples-total').innerText === '{len(rewards)} matching samples'"
    )
    page.locator("#f-correct label", has_text="no").click()
    page.wait_for_function(
        f"document.querySelector('#samples-total').innerText === '{len(wrong)} matching samples'"
    )
    browser.rows("samples-grid", len(wrong))
    shown = page.locator('#samples-grid .ag-center-cols-container [col-id="sample_id"]').all_inner_texts()
    correct = page.locator('#samples-grid .ag-center-cols-container [col-id="correct"]').all_inner_texts()
    assert set(shown) == wrong
    assert {c.strip().lower() for c in correct} == {"false"}
    browser.shot("samples")


def test_sorting_and_paging_happen_on_the_server(browser: Browser, browse_run: BrowseRun) -> None:
    store = ArtifactStore(browse_run.store_url)
    rewards = sorted(r["score"] for r in _table(store, browse_run.run_id, f"{KEY}/reward", "rewards.parquet"))
    page = browser.page
    browser.open(
        f"/run/{browse_run.run_id}/samples?kind=train&key={KEY}&page_size=5", "#samples-grid .ag-row"
    )
    label = page.locator("#samples-page-label")
    pages = (len(rewards) + 4) // 5

    def shown(expected: list[float], at: int) -> None:
        """The page's rewards are ``expected`` (as a multiset) and the label says page ``at``."""
        cells = page.locator('#samples-grid .ag-center-cols-container [col-id="reward"]')
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            got = sorted(float(t) for t in cells.all_inner_texts())
            if got == pytest.approx(sorted(expected)) and label.inner_text() == f"page {at} of {pages}":
                return
            time.sleep(0.2)
        raise AssertionError(f"page {label.inner_text()}: {got} != {sorted(expected)}")

    header = page.locator('#samples-grid .ag-header-cell[col-id="reward"] .ag-header-cell-label')
    header.click()  # ascending: page 1 holds the 5 lowest rewards of all 16, not of the first 5 rows
    shown(rewards[:5], 1)
    page.locator("#samples-next").click()
    shown(rewards[5:10], 2)
    header.click()  # descending, back to the first page
    shown(rewards[::-1][:5], 1)


def test_group_view_shows_the_n_responses(browser: Browser, browse_run: BrowseRun) -> None:
    store = ArtifactStore(browse_run.store_url)
    rollouts = _table(store, browse_run.run_id, f"{KEY}/rollout", "rollouts.parquet")
    rewards = {
        (r["group_id"], r["sample_index"]): r["score"]
        for r in _table(store, browse_run.run_id, f"{KEY}/reward", "rewards.parquet")
    }
    prompt = rollouts[0]["prompt_index"]
    mine = {
        f"{r['group_id']}:{r['sample_index']}": rewards[r["group_id"], r["sample_index"]]
        for r in rollouts
        if r["prompt_index"] == prompt
    }
    assert len(mine) == GROUP_SIZE
    browser.open(f"/run/{browse_run.run_id}/group?kind=train&key={KEY}&prompt={prompt}", "#group-responses")
    cards = browser.page.locator("#group-responses .group-response")
    assert cards.count() == GROUP_SIZE
    for i in range(GROUP_SIZE):
        card = cards.nth(i)
        sid = card.get_attribute("data-sample-id")
        assert float(card.locator(".fact-reward").inner_text()) == pytest.approx(mine[sid], abs=1e-3)
    browser.shot("group")


def test_token_view_colours_each_token_by_its_value(browser: Browser, browse_run: BrowseRun) -> None:
    store = ArtifactStore(browse_run.store_url)
    rollouts = _table(store, browse_run.run_id, f"{KEY}/rollout", "rollouts.parquet")
    update = {
        (u["group_id"], u["sample_index"]): u
        for u in _table(store, browse_run.run_id, f"{KEY}/update", "update.parquet")
    }
    # the sample with the largest |advantage|: its tokens are coloured, not transparent
    r = max(rollouts, key=lambda r: abs(update[r["group_id"], r["sample_index"]]["advantages"][0]))
    u = update[r["group_id"], r["sample_index"]]
    sample = f"{r['group_id']}:{r['sample_index']}"
    browser.open(f"/run/{browse_run.run_id}/tokens?kind=train&key={KEY}&sample={sample}", "#tokens-view .tok")
    spans = browser.page.locator("#tokens-view .tok")
    assert spans.count() == r["response_length"]

    def values() -> list[float]:
        return [float(v) for v in spans.evaluate_all("els => els.map(e => e.dataset.value)")]

    assert values() == pytest.approx(u["advantages"], abs=1e-6)
    title = spans.nth(0).get_attribute("title") or ""
    assert title.startswith("#0 ") and f"id {r['response_ids'][0]}" in title and "advantage" in title
    background = spans.nth(0).evaluate("e => getComputedStyle(e).backgroundColor")
    assert background not in ("rgba(0, 0, 0, 0)", "transparent")  # |advantage| at its max: full colour
    browser.shot("tokens-advantage")
    # mismatch = behaviour log-prob (the rollout's) - the trainer's recomputed log-prob (the update's)
    browser.page.locator("#tokens-colour label", has_text="mismatch").click()
    expected = [b - t for b, t in zip(r["logprobs"], u["old_log_probs"], strict=True)]
    browser.page.wait_for_function("document.querySelector('#tokens-view .tok').title.length > 0")
    deadline = time.monotonic() + 20
    while values() != pytest.approx(expected, abs=1e-6) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert values() == pytest.approx(expected, abs=1e-6)
    browser.page.wait_for_selector("#mismatch-list table")  # filled in after the tokens
    browser.shot("tokens-mismatch")


def test_rescore_disagreements_match_its_report(browser: Browser, browse_run: BrowseRun) -> None:
    store = ArtifactStore(browse_run.store_url)
    stage = f"rescore/{browse_run.rescore}/report"
    report = store.committed(browse_run.run_id, stage)
    assert report is not None
    disagreeing = _table(store, browse_run.run_id, stage, "disagreements.parquet")
    assert disagreeing  # the rule scorer fails every sample half_credit had correct
    browser.open(f"/run/{browse_run.run_id}/rescores/{browse_run.rescore}", "#rescore-disagreements .ag-row")
    page = browser.page
    rows = browser.rows("rescore-disagreements", len(disagreeing))
    shown = set()
    for i in range(rows.count()):
        row = rows.nth(i)
        cell = {
            c: row.locator(f'[col-id="{c}"]').inner_text()
            for c in ("source", "sample_id", "correct_old", "correct_new")
        }
        shown.add((cell["source"], cell["sample_id"], cell["correct_old"], cell["correct_new"]))
    expected = {
        (
            d["source"],
            f"{d['group_id']}:{d['sample_index']}",
            str(d["correct_old"]).lower(),
            str(d["correct_new"]).lower(),
        )
        for d in disagreeing
    }
    assert shown == expected
    total = report.summary["total"]
    agreement = page.locator("#rescore-agreement tbody tr", has_text="all")
    assert f"{total['agreement']:.4g}" in agreement.inner_text()
    browser.shot("rescore")


def test_prompt_history_and_config_pages(browser: Browser, browse_run: BrowseRun) -> None:
    store = ArtifactStore(browse_run.store_url)
    prompt = _table(store, browse_run.run_id, f"{KEY}/rollout", "rollouts.parquet")[0]["prompt_index"]
    browser.open(f"/run/{browse_run.run_id}/prompt?prompt={prompt}", "#prompt-history")
    assert browser.page.locator("#prompt-history .history-iteration").count() >= 1
    browser.shot("prompt")
    browser.open(f"/run/{browse_run.run_id}/config", "#config-table")
    assert "algorithm.adv_estimator" in browser.page.locator("#config-table").inner_text()
    browser.shot("config")
