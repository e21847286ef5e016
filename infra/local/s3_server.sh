#!/usr/bin/env bash
# Start an S3-compatible endpoint (moto server) on 127.0.0.1 for local runs against s3:// stores.
#   infra/local/s3_server.sh [PORT]      then, in the shell that runs verl-flow:
#   export AWS_ENDPOINT_URL_S3=http://127.0.0.1:${PORT:-9000} AWS_ACCESS_KEY_ID=local AWS_SECRET_ACCESS_KEY=local
#   python -c "import boto3; boto3.client('s3').create_bucket(Bucket='verl-flow')"
#   verl-flow run configs/quickstart.yaml store.url=s3://verl-flow/team
set -euo pipefail
PORT="${1:-9000}"
exec "$(dirname "$0")/../../.venv/bin/moto_server" -H 127.0.0.1 -p "$PORT"
