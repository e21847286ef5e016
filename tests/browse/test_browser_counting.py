"""The samples grid's garbled filter in a real browser while the set's background flags are not in
yet: the page comes first, flagged on the fly, with "counting…" where the count goes, and the count
follows once the background pass ends (the grid asks again every ``COUNT_POLL_MS``).

The app is served in this process (werkzeug, the server Dash's Flask app runs under) so that the
background pass can be held back: it waits for an event the test sets once the page is checked.
What the page shows is checked against the run's Parquet files read with pyarrow and
:func:`browse.garbled.garbled_reason` (the heuristics the pass runs)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from browse import derived
from browse.app import create_app
from browse.derived import Derived
from browse.garbled import garbled_reason
from browse.queries import Catalog
from tests.browse.conftest import BrowseRun
from tests.browse.test_browser import CHROMIUM, KEY, _table, chromium_page
from verl_core.store import ArtifactStore

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (make chromium installs it as root)"
)
PAGE = 3  # rows per page: the on-the-fly flags stop once a page is full, before the set's end


@contextmanager
def served(catalog: Catalog) -> Iterator[str]:
    """The browser app over ``catalog`` on a free port of 127.0.0.1: yields the base URL."""
    server = make_server("127.0.0.1", 0, create_app(catalog).server, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_a_garbled_filter_shows_its_page_then_its_count(
    browse_run: BrowseRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(browse_run.store_url)
    rollouts = _table(store, browse_run.run_id, f"{KEY}/rollout", "rollouts.parquet")
    flags = {
        (r["group_id"], r["sample_index"]): bool(
            garbled_reason(r["response_text"] or "", r["finish_reason"] == "length")
        )
        for r in rollouts
    }
    # the filter on the side with more rows (a tiny run from scratch: often all of them garbled)
    shown = sum(flags.values()) >= len(flags) / 2
    matching = sorted(k for k, flag in flags.items() if flag == shown)
    # the first page needs PAGE = 3 matching rows, flagged 2, 4, then 8 rows at a time: with 8 or more
    # of the 16 matching, the first 14 rows hold 6 or more, so the page is full by the third block
    # (rows 6..13, a full block): rows are left unseen, and the count is not known with the page
    assert len(flags) == 16 and len(matching) >= 8
    want_page = [f"{g}:{i}" for g, i in matching[:PAGE]]

    release = threading.Event()
    fill = Derived._fill_garbled

    def held_back(self: Derived, table: str) -> None:
        assert release.wait(120), "the test never released the background pass"
        fill(self, table)

    monkeypatch.setattr(Derived, "_fill_garbled", held_back)
    monkeypatch.setattr(derived, "EARLY_BLOCK", 2)
    try:
        with served(Catalog(browse_run.store_url)) as base, chromium_page(base, tmp_path) as browser:
            page = browser.page
            browser.open(
                f"/run/{browse_run.run_id}/samples?kind=train&key={KEY}&page_size={PAGE}",
                "#samples-grid .ag-row",
            )  # no garbled filter: the page and its count do not wait for the flags
            page.wait_for_function(
                f"document.querySelector('#samples-total').innerText === '{len(rollouts)} matching samples'"
            )
            page.locator("#f-garbled label", has_text="yes" if shown else "no").click()
            page.wait_for_function(
                "document.querySelector('#samples-total').innerText.startsWith('counting')"
            )
            cells = page.locator('#samples-grid .ag-center-cols-container [col-id="sample_id"]')
            assert browser.rows("samples-grid", PAGE) and cells.all_inner_texts() == want_page
            assert page.locator("#samples-page-label").inner_text() == "page 1"  # of ? pages
            browser.shot("samples-counting")
            release.set()
            page.wait_for_function(  # the poll asks again; its answer waits for the pass
                f"document.querySelector('#samples-total').innerText === '{len(matching)} matching samples'",
                timeout=30_000,
            )
            pages = (len(matching) + PAGE - 1) // PAGE
            assert page.locator("#samples-page-label").inner_text() == f"page 1 of {pages}"
            assert cells.all_inner_texts() == want_page
    finally:
        release.set()
