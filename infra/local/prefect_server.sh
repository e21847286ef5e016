#!/usr/bin/env bash
# Start a Prefect server on 127.0.0.1 (the UI at http://127.0.0.1:PORT) in this shell:
#   infra/local/prefect_server.sh [PORT]
# Changes no Prefect profile: every shell that should use the server runs the printed
#   export PREFECT_API_URL=http://127.0.0.1:PORT/api
# (without it, `verl-flow run` starts a temporary server for the run, as before).
set -euo pipefail
PORT="${1:-4200}"
PREFECT="$(dirname "$0")/../../.venv/bin/prefect"
[ -x "$PREFECT" ] || PREFECT=prefect  # no .venv in this checkout: the prefect on PATH
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
echo "In every shell that should use this server:  export PREFECT_API_URL=http://127.0.0.1:${PORT}/api"
exec "$PREFECT" server start --host 127.0.0.1 --port "$PORT" --analytics-off
