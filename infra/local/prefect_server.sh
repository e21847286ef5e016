#!/usr/bin/env bash
# Start a Prefect server on 127.0.0.1 (the UI at http://127.0.0.1:4200) and point this shell's
# Prefect profile at it:  infra/local/prefect_server.sh [PORT]
set -euo pipefail
PORT="${1:-4200}"
BIN="$(dirname "$0")/../../.venv/bin"
export DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
"$BIN/prefect" config set PREFECT_API_URL="http://127.0.0.1:${PORT}/api" >/dev/null
exec "$BIN/prefect" server start --host 127.0.0.1 --port "$PORT" --analytics-off
