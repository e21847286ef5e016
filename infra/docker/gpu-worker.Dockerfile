# GPU worker image for verl-flow's `gpu` work pool: two environments, as on CPU machines (README "Two
# environments"): /opt/venv, the pipeline (CUDA torch + flash-attn + verl-flow with Prefect/MLflow), and
# /opt/vllm-venv, the rollout engine (vLLM with its own pins + verl_core, the project with --no-deps),
# whose interpreter the stages start their vLLM engine with ($VERL_FLOW_VLLM_PYTHON). A Prefect process
# worker is the default command. Build from the repository root:
#
#   docker build -f infra/docker/gpu-worker.Dockerfile -t verl-flow-gpu-worker:0.1.0 .
#   docker run --gpus all --ipc=host -e PREFECT_API_URL=http://prefect:4200/api \
#       -e AWS_ENDPOINT_URL_S3=... -e AWS_ACCESS_KEY_ID=... -e AWS_SECRET_ACCESS_KEY=... \
#       verl-flow-gpu-worker:0.1.0                   # = prefect worker start --pool gpu
#
# --ipc=host (or --shm-size=16g): weight syncs to vLLM stage the whole policy in /dev/shm (a 0.5B model
# in bf16 is ~1 GB, fp32 twice that) and NCCL uses it too; Docker's default /dev/shm is 64 MB. Where it
# is too small, syncs fall back to the disk and say so once (verl_core/rollout/weight_sync.py);
# `verl-flow doctor --config CONFIG` in the container reports /dev/shm against the config's model.
#
# The same image serves a Kubernetes work pool (infra/k8s/gpu-base-job-template.json, with a memory
# emptyDir on /dev/shm): there each flow run is a Job running this image. prefect.yaml's pull step sets
# the working directory to $VERL_FLOW_HOME, which this image sets to the copied checkout.
#
# Pins (why the environments differ). tests/flows/test_infra_gpu_image.py resolves
# both environments for linux x86_64 with `uv pip compile` and checks the CUDA major below against the
# resolved torch, in `make test`:
#   vllm 0.33.0       (infra/vllm/requirements-gpu.txt) pins torch==2.14.0 and transformers>=5.16.1,<5.21
#                     and caps fastapi below Prefect 3.8.8's floor: it gets its own venv. The pipeline
#                     venv takes the same torch/transformers (frozen from the vLLM venv as constraints),
#                     so both sides compute with one torch build; verl-flow's range (>=5.16.1,<5.24) covers it.
#   CUDA 13.0         torch 2.14.0 on PyPI is a CUDA 13 build (it requires cuda-toolkit==13.0.*,
#                     nvidia-nccl-cu13; vLLM 0.33's .so files link libcudart.so.13), so the host driver
#                     must support CUDA 13 (R580+). The devel base brings nvcc 13.0: torch's extension
#                     builder refuses an nvcc of another major than torch.version.cuda.
#   flash-attn        2.8.3.post2 is source-only: it compiles against the installed torch with that nvcc,
#                     hence --no-build-isolation, with its setup.py's imports (torch, packaging, wheel,
#                     setuptools; ninja for a parallel build) installed first. MAX_JOBS bounds the
#                     compile's RAM (~4 GB per job); the build takes tens of minutes.
#   python 3.12       Ubuntu 24.04's own.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

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
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev git build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv \
 && python3.12 -m venv /opt/vllm-venv
ENV PATH=/opt/venv/bin:$PATH
COPY . ${VERL_FLOW_HOME}

# 1. The vLLM environment: vLLM decides torch (CUDA build) and transformers; then verl_core beside it
RUN /opt/vllm-venv/bin/pip install --upgrade pip \
 && /opt/vllm-venv/bin/pip install -r ${VERL_FLOW_HOME}/infra/vllm/requirements-gpu.txt \
 && /opt/vllm-venv/bin/pip install --no-deps -e "${VERL_FLOW_HOME}" \
 && /opt/vllm-venv/bin/python -c "from verl_core.runtime.doctor import require_vllm; require_vllm('the GPU worker image')"
# 2. The pipeline: the same torch/transformers/tokenizers/triton and flash-attn's build dependencies,
#    flash-attn compiled against that torch by the base image's nvcc, then verl-flow
RUN /opt/vllm-venv/bin/pip freeze | grep -iE '^(torch|transformers|tokenizers|triton)==' > /opt/gpu-pins.txt \
 && /opt/venv/bin/pip install --upgrade pip \
 && /opt/venv/bin/pip install -c /opt/gpu-pins.txt torch packaging wheel "setuptools>=68" ninja \
 && MAX_JOBS=${MAX_JOBS} /opt/venv/bin/pip install --no-build-isolation -c /opt/gpu-pins.txt "flash-attn==${FLASH_ATTN_VERSION}" \
 && /opt/venv/bin/pip install -c /opt/gpu-pins.txt -e "${VERL_FLOW_HOME}" \
 && /opt/venv/bin/pip check \
 && /opt/venv/bin/python -c "import torch, flash_attn, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'flash-attn', flash_attn.__version__, 'transformers', transformers.__version__)"

WORKDIR ${VERL_FLOW_HOME}
CMD ["prefect", "worker", "start", "--pool", "gpu", "--type", "process"]
