"""``verl-flow browse``: the rollout browser (:mod:`browse.app`) over a store's runs, read-only, on
127.0.0.1 unless ``--host`` says otherwise. One process: werkzeug's threaded server runs the Dash
app until Ctrl-C or SIGTERM. While it serves, a record under the user's state directory tells the
pipeline's runs on this store where it is (:mod:`browse.record`), so their Prefect flow run links
to the run's page."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType
from typing import Annotated

import typer

from flows.cli.common import StoreOpt, fail, open_store, out
from verl_core.errors import VerlFlowError

DEFAULT_PORT = 8050


def browse_url(host: str, port: int, run_ids: list[str]) -> str:
    """The URL ``browse`` prints: the run's page for one run, else the runs page."""
    from urllib.parse import quote

    shown = "localhost" if host in ("127.0.0.1", "localhost") else host
    base = f"http://{shown}:{port}"
    return f"{base}/run/{quote(run_ids[0], safe='')}" if len(run_ids) == 1 else f"{base}/"


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def browse_cmd(
    run_ids: Annotated[
        list[str] | None, typer.Argument(help="Runs to show (default: every run of the store)")
    ] = None,
    store: StoreOpt = None,
    port: Annotated[int, typer.Option(help="Port to serve on (0: any free port)")] = DEFAULT_PORT,
    host: Annotated[
        str, typer.Option(help="Address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface)")
    ] = "127.0.0.1",
) -> None:
    """Browse the runs' samples, groups, tokens and rescores in a web browser (read-only): prints the
    URL and serves until Ctrl-C."""
    from werkzeug.serving import make_server

    from browse.app import create_app
    from browse.queries import Catalog
    from browse.record import remove_record, write_record

    st = open_store(store)
    ids = list(run_ids or [])
    try:
        known = set(st.list_runs())
        missing = [r for r in ids if r not in known]
        if missing:
            fail(f"no run {', '.join(missing)} in {st.url}", 1)
        catalog = Catalog(st.url, ids or None)
    except VerlFlowError as e:
        fail(e, 1)
    app = create_app(catalog)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    try:
        server = make_server(host, port, app.server, threaded=True)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e}", 1)
    port = server.server_port  # --port 0: a free port the system chose
    url = browse_url(host, port, ids)
    record = write_record(f"http://{host if host != '0.0.0.0' else '127.0.0.1'}:{port}", st.url, ids)
    signal.signal(signal.SIGTERM, _stop)
    out.print(f"browsing {st.url} at {url}  (Ctrl-C stops)", highlight=False, soft_wrap=True)
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        remove_record(record)
    out.print("stopped")
