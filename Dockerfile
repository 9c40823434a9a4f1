# cai-dllm server image.
#   GPU (default): docker build -t cai-dllm .
#   CPU:           docker build --build-arg DEVICE=cpu -t cai-dllm:cpu .
# Models are mounted read-only at /models; the bundled llada-tiny is served when no model is given:
#   docker run --gpus all -p 8000:8000 -v /data/LLaDA-8B-Instruct:/models/LLaDA-8B-Instruct:ro \
#     cai-dllm --model /models/LLaDA-8B-Instruct --dtype bfloat16 --device cuda
ARG DEVICE=cuda
ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0

# ---- build stages: one virtual environment at /opt/venv, then copied into a slim runtime ----
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU} AS build-cuda
ARG TORCH_VERSION
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 MAX_JOBS=4
# Ubuntu's python3 is whatever the base image's release ships: pinning its patch version would break each rebuild
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install "torch==${TORCH_VERSION}" packaging ninja wheel
# flash-attn compiles against the torch above; its build needs the CUDA toolkit of this stage only
RUN /opt/venv/bin/pip install --no-build-isolation "flash-attn>=2.6" "nvidia-ml-py>=12"

FROM ${PYTHON_IMAGE} AS build-cpu
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

# hadolint ignore=DL3006
FROM build-${DEVICE} AS build
# optional extras of the project, e.g. EXTRAS=ray for a KubeRay image
ARG EXTRAS=""
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY server ./server
COPY tinymodels ./tinymodels
COPY calibration ./calibration
COPY bench/__init__.py bench/load_generator.py ./bench/
RUN if [ -n "${EXTRAS}" ]; then /opt/venv/bin/pip install --no-cache-dir ".[${EXTRAS}]"; \
    else /opt/venv/bin/pip install --no-cache-dir .; fi

# ---- runtime stages: the interpreter the venv was made with, and nothing to compile with ----
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${UBUNTU} AS runtime-cuda
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/*

FROM ${PYTHON_IMAGE} AS runtime-cpu

# hadolint ignore=DL3006
FROM runtime-${DEVICE}
ARG DEVICE
RUN useradd --create-home --uid 10001 caidllm \
 && mkdir -p /models && chown caidllm /models
COPY --from=build /opt/venv /opt/venv
COPY --chown=caidllm models/llada-tiny /opt/cai-dllm/models/llada-tiny
# Every server setting is a CAI_DLLM_* variable (docs/server.md); these are the image's defaults.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    CAI_DLLM_MODEL=/opt/cai-dllm/models/llada-tiny \
    CAI_DLLM_HOST=0.0.0.0 \
    CAI_DLLM_PORT=8000 \
    CAI_DLLM_DEVICE=${DEVICE}
USER 10001
WORKDIR /home/caidllm
EXPOSE 8000
VOLUME ["/models"]
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('CAI_DLLM_PORT', '8000')}/health\", timeout=4)"]
ENTRYPOINT ["cai-dllm", "serve"]
