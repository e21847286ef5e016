#!/usr/bin/env bash
# Start an MLflow tracking server on 127.0.0.1 backed by the local store's SQLite database.
#   infra/local/mlflow_server.sh [PORT] [STORE_DIR]   then: verl-flow run ... tracking.uri=http://127.0.0.1:5000
set -euo pipefail
PORT="${1:-5000}"
STORE="${2:-runs}"
mkdir -p "$STORE"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_DISABLE_TELEMETRY=true
exec "$(dirname "$0")/../../.venv/bin/mlflow" server --host 127.0.0.1 --port "$PORT" \
  --backend-store-uri "sqlite:///$(cd "$STORE" && pwd)/mlflow.db" \
  --artifacts-destination "$(cd "$STORE" && pwd)/mlartifacts"
