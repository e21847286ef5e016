# GPU worker image for verl-flow's `gpu` work pool: CUDA torch + vLLM + flash-attn + verl-flow, and a
# Prefect process worker as the default command. Build from the repository root:
#
#   docker build -f infra/docker/gpu-worker.Dockerfile -t verl-flow-gpu-worker:0.1.0 .
#   docker run --gpus all -e PREFECT_API_URL=http://prefect:4200/api \
#       -e AWS_ENDPOINT_URL_S3=... -e AWS_ACCESS_KEY_ID=... -e AWS_SECRET_ACCESS_KEY=... \
#       verl-flow-gpu-worker:0.1.0                   # = prefect worker start --pool gpu
#
# The same image serves a Kubernetes work pool (infra/k8s/gpu-base-job-template.json): there each flow
# run is a Job running this image. prefect.yaml's pull step sets the working directory to
# $VERL_FLOW_HOME, which this image sets to the copied checkout.
#
# Pins (why this environment differs from the CPU one; see STACK_NOTES):
#   vllm 0.33.0       pins torch==2.14.0 and transformers>=5.16.1,<5.21.0. The CPU environment runs
#                     torch 2.13.0 + transformers 5.23; verl-flow's range (>=5.16.1,<5.24) covers both,
#                     so here pip keeps vLLM's torch/transformers (they are installed first and then
#                     frozen as constraints for verl-flow).
#   flash-attn        2.8.3.post2 is source-only: it compiles against the installed torch with nvcc,
#                     hence the CUDA *devel* base image and --no-build-isolation (MAX_JOBS bounds RAM).
#   CUDA 12.8         the CUDA of vLLM 0.33's torch 2.14 wheels on PyPI.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

ARG VLLM_VERSION=0.33.0
ARG FLASH_ATTN_VERSION=2.8.3.post2
ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VERL_FLOW_HOME=/opt/verl-flow \
    DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_DISABLE_TELEMETRY=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev git build-essential ninja-build \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# 1. vLLM first: it decides torch (CUDA build) and transformers
RUN pip install --upgrade pip && pip install "vllm==${VLLM_VERSION}"
# 2. flash-attn, compiled against that torch
RUN MAX_JOBS=${MAX_JOBS} pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"
# 3. verl-flow, holding torch/transformers/tokenizers to what vLLM brought
COPY . ${VERL_FLOW_HOME}
RUN pip freeze | grep -iE '^(torch|transformers|tokenizers|triton)==' > /opt/gpu-pins.txt \
 && pip install -c /opt/gpu-pins.txt -e "${VERL_FLOW_HOME}" \
 && pip check \
 && python -c "import torch, vllm, flash_attn, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'flash-attn', flash_attn.__version__, 'transformers', transformers.__version__)"

WORKDIR ${VERL_FLOW_HOME}
CMD ["prefect", "worker", "start", "--pool", "gpu", "--type", "process"]
