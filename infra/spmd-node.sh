#!/usr/bin/env bash
# One node of a multi-node verl-flow run (infra/k8s/, infra/slurm/ call it, one process per node):
#   infra/spmd-node.sh NODE_INDEX [COMMAND...]
# Node 0 runs COMMAND when given (a Prefect flow run's command, infra/k8s/spmd-base-job-template.json),
# else the pipeline `verl-flow run $VERL_FLOW_CONFIG` with the job geometry as overrides; it launches
# each SPMD job (SFT, RL loop) with torchrun and hosts the rendezvous. Nodes 1..N-1 run
# `verl-flow spmd-follow`: the same torchrun command, once per job, until node 0's final job.
# Environment (the geometry must be the same on every node, and node 0's config must agree with it):
#   VERL_FLOW_NNODES           N (trainer.nnodes)
#   VERL_FLOW_NPROC_PER_NODE   processes (GPUs) per node (trainer.n_gpus_per_node)
#   VERL_FLOW_RDZV_ENDPOINT    HOST:PORT that reaches node 0 (trainer.rdzv_endpoint)
#   VERL_FLOW_RDZV_ID          optional (trainer.rdzv_id; default its schema default)
#   VERL_FLOW_CONFIG           node 0 without COMMAND: the YAML config
#   VERL_FLOW_OVERRIDES        node 0 without COMMAND: more overrides, space-separated (store.url=s3://...)
#   VERL_FLOW_MAX_JOBS         followers: stop after this many jobs (1 when the pod/step holds one stage flow run)
#   VERL_FLOW_WAIT_DNS_S       optional: wait up to this many seconds for the endpoint's host to resolve
set -euo pipefail
index="${1:?usage: spmd-node.sh NODE_INDEX [COMMAND...]}"
shift
: "${VERL_FLOW_NNODES:?}" "${VERL_FLOW_NPROC_PER_NODE:?}" "${VERL_FLOW_RDZV_ENDPOINT:?}"
rdzv_host="${VERL_FLOW_RDZV_ENDPOINT%:*}"
for ((i = 0; i < ${VERL_FLOW_WAIT_DNS_S:-0}; i++)); do
  getent hosts "$rdzv_host" >/dev/null && break
  sleep 1
done
rdzv_id=()
[[ -n "${VERL_FLOW_RDZV_ID:-}" ]] && rdzv_id=(--rdzv-id "$VERL_FLOW_RDZV_ID")
if [[ "$index" == 0 ]]; then
  if (($# > 0)); then
    exec "$@"
  fi
  read -r -a overrides <<<"${VERL_FLOW_OVERRIDES:-}"
  geometry=(
    "trainer.nnodes=$VERL_FLOW_NNODES"
    "trainer.n_gpus_per_node=$VERL_FLOW_NPROC_PER_NODE"
    "trainer.rdzv_endpoint=$VERL_FLOW_RDZV_ENDPOINT"
  )
  [[ -n "${VERL_FLOW_RDZV_ID:-}" ]] && geometry+=("trainer.rdzv_id=$VERL_FLOW_RDZV_ID")
  exec verl-flow run "${VERL_FLOW_CONFIG:?}" "${geometry[@]}" "${overrides[@]}"
fi
max_jobs=()
[[ -n "${VERL_FLOW_MAX_JOBS:-}" ]] && max_jobs=(--max-jobs "$VERL_FLOW_MAX_JOBS")
exec verl-flow spmd-follow --nnodes "$VERL_FLOW_NNODES" --nproc-per-node "$VERL_FLOW_NPROC_PER_NODE" \
  --rdzv-endpoint "$VERL_FLOW_RDZV_ENDPOINT" "${rdzv_id[@]}" "${max_jobs[@]}"
