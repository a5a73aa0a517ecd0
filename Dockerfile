# syntax=docker/dockerfile:1
# SITS images, two targets:
#   docker build --target runtime  -t registry.example.com/sits-runtime:0.1.0 .
#   docker build --target operator -t registry.example.com/sits-operator:0.1.0 .
# runtime: `sits serve` on a CUDA base with torch and triton (the SitsDeployment's spec.image).
# operator: `python -m sits.operator` on slim Python, without torch (the Helm chart's image).
# Both run as the unprivileged user 10001 and need no writable root filesystem beyond $HOME and /tmp.

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# -- the sits wheel (pure Python), shared by both targets -----------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernels ./kernels
COPY runtime ./runtime
COPY operator ./operator
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- runtime: the inference server ---------------------------------------------------------------
FROM ${CUDA_IMAGE} AS runtime
ARG TORCH_VERSION=2.8.0
ARG TRITON_VERSION=3.4.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's Python 3.12, and a C compiler: Triton builds its small launcher stubs with it at first use.
# The base image's tag pins the Ubuntu release; its archive keeps only the current patch versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
COPY --from=wheel /wheels /wheels
# with the `tracing` extra (pinned), so --otlp-endpoint works; OpenTelemetry is imported only when it is given
RUN pip install --no-cache-dir /wheels/sits-*.whl \
        opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2 \
    && rm -rf /wheels
RUN useradd --uid 10001 --create-home --home-dir /home/sits --shell /usr/sbin/nologin sits
ENV HOME=/home/sits \
    SITS_CACHE_DIR=/home/sits/.cache/sits \
    TRITON_CACHE_DIR=/home/sits/.triton
USER 10001
WORKDIR /home/sits
EXPOSE 8000
# Kubernetes uses the pod's probes (/health, /health/live); this is for docker run and compose.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/live', timeout=4)"]
# The operator's pods pass `serve --host 0.0.0.0 --port 8000 --model ...` as args.
ENTRYPOINT ["sits"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

# -- operator: the SitsDeployment controller -------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONSAFEPATH=1
# The operator's own dependencies (the `operator` extra, pinned); the sits wheel without its
# runtime dependencies, so no torch in this image.
RUN pip install --no-cache-dir kopf==1.45.2 kubernetes==37.0.2 aiohttp==3.14.5 PyYAML==6.0.4 redis==8.1.0 \
    prometheus-client==0.26.0
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir --no-deps /wheels/sits-*.whl && rm -rf /wheels \
    && useradd --uid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin sits
USER 10001
WORKDIR /tmp
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "sits.operator"]
