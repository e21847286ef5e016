#!/usr/bin/env bash
# Work pools for one machine (process workers): `cpu` for the pipeline flow, `gpu` for the GPU stage
# flows with a concurrency limit of one flow run per GPU. Idempotent.
#   infra/prefect/create_pools.sh [GPUS]        (PREFECT_API_URL must point at the server)
# then start one worker per pool (each in its own shell, from the checkout):
#   VERL_FLOW_HOME=$PWD prefect worker start --pool cpu
#   VERL_FLOW_HOME=$PWD CUDA_VISIBLE_DEVICES=0 prefect worker start --pool gpu
set -euo pipefail
GPUS="${1:-1}"
PREFECT="${PREFECT:-$(dirname "$0")/../../.venv/bin/prefect}"
for pool in cpu gpu; do
  if ! "$PREFECT" work-pool inspect "$pool" >/dev/null 2>&1; then
    "$PREFECT" work-pool create "$pool" --type process
  fi
done
"$PREFECT" work-pool set-concurrency-limit gpu "$GPUS"
