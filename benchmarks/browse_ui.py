"""Rollout browser, end to end: seconds from a filter's click in Chromium to the samples grid showing
the new match count, over the 100,000-sample set that ``benchmarks/browse_filter.py --store DIR``
writes (run ``bench``, iteration 0). It starts ``verl-flow browse`` on the store and drives Debian's
Chromium through Playwright (as tests/browse/test_browser.py does); each line is one click, in order,
so a filter's figure includes the server's query, the callback's round trip and the grid's render.

    .venv/bin/python benchmarks/browse_filter.py --rows 100000 --store /tmp/bench100k
    .venv/bin/python benchmarks/browse_ui.py --store /tmp/bench100k
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
CHROMIUM_ARGS += ["--disable-component-update", "--disable-sync", "--no-first-run"]


def serve(store: str, run: str) -> tuple[subprocess.Popen[str], str]:
    """``verl-flow browse RUN`` on a free port; returns the process and its base URL."""
    env = {**os.environ, "XDG_STATE_HOME": tempfile.mkdtemp(prefix="browse-ui-bench-")}
    cmd = [sys.executable, "-m", "flows.cli", "browse", run, "--store", store, "--port", "0"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    seen = ""
    while not (m := re.search(r"http://localhost:(\d+)", seen)):
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"verl-flow browse exited:\n{seen}")
        seen += line
    return proc, f"http://127.0.0.1:{m.group(1)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="the store benchmarks/browse_filter.py wrote")
    ap.add_argument("--run", default="bench")
    ap.add_argument("--key", default="iter-0000")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    proc, base = serve(args.store, args.run)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, headless=True, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            total = "(document.querySelector('#samples-total') || {innerText: ''}).innerText"
            t0 = time.perf_counter()
            page.goto(f"{base}/run/{args.run}/samples?kind=train&key={args.key}")
            page.wait_for_function(f"{total}.includes('matching')", timeout=300_000)
            shown = page.inner_text("#samples-total")
            print(f"{'first page (the set opened)':34s} {time.perf_counter() - t0:7.3f} s  {shown}")

            def timed(label: str, action: Callable[[], Any]) -> None:
                before = page.inner_text("#samples-total")
                t = time.perf_counter()
                action()
                page.wait_for_function(f"{total} !== {before!r}", timeout=300_000)
                print(f"{label:34s} {time.perf_counter() - t:7.3f} s  {page.inner_text('#samples-total')}")
                if "counting" in page.inner_text("#samples-total"):  # a garbled page before its count
                    page.wait_for_function(f"!{total}.includes('counting')", timeout=300_000)
                    shown = page.inner_text("#samples-total")
                    print(f"{'  (its count)':34s} {time.perf_counter() - t:7.3f} s  {shown}")

            def radio(control: str, text: str) -> Callable[[], Any]:
                return lambda: page.locator(f"#{control} label", has_text=text).click()

            def box(control: str, value: str) -> Callable[[], Any]:
                return lambda: (page.fill(f"#{control}", value), page.press(f"#{control}", "Enter"))

            timed("correct = no", radio("f-correct", "no"))
            timed("correct = yes", radio("f-correct", "yes"))
            timed("text 'subtract'", box("f-text", "subtract"))
            timed("correct = any", radio("f-correct", "any"))
            timed("reward <= 0.2", box("f-reward-max", "0.2"))
            timed("garbled = yes (first use)", radio("f-garbled", "yes"))
            timed("garbled = no", radio("f-garbled", "no"))
            cell = "#samples-grid .ag-center-cols-container [col-id=sample_id]"
            first = f"document.querySelector('{cell}').innerText"
            before = page.evaluate(first)
            t = time.perf_counter()
            page.locator(
                '#samples-grid .ag-header-cell[col-id="response_length"] .ag-header-cell-label'
            ).click()
            page.wait_for_function(f"{first} !== {before!r}", timeout=300_000)
            print(f"{'sort by length':34s} {time.perf_counter() - t:7.3f} s")
            browser.close()
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
