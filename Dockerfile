# gpt2-serve in a container. CPU by default:
#   docker build -t gpt2-server .
#   docker run -p 8000:8000 -v gpt2-hf:/data/hf gpt2-server                 # gpt2, downloaded once into the volume
#   docker run -p 8000:8000 -v gpt2-hf:/data/hf gpt2-server --model gpt2-medium
#   docker run --stop-timeout 150 ...   # docker stop's default 10 s would kill streams mid-body: see --drain-timeout
# Arguments after the image name are gpt2-serve's flags (gpt2-serve --help); each also reads GPT2_<NAME>.
# To listen on another port, set GPT2_PORT (the health check reads it) rather than --port.
#
# GPU: a CUDA base image whose python (3.10+) and pip can install packages, and the matching torch wheels:
#   docker build -t gpt2-server:cuda \
#     --build-arg BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 --build-arg TORCH_VERSION=2.7.1 .
#   docker run --gpus all -p 8000:8000 -v gpt2-hf:/data/hf gpt2-server:cuda
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Where torch comes from: CPU-only wheels by default (PyPI's default Linux wheel pulls in CUDA, ~3 GB more).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Which torch: the version the test suite runs on (within pyproject.toml's range, which tests/test_docker.py
# checks), not the newest the range allows, which no test has seen. A base image that has it already keeps it.
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/data/hf \
    GPT2_HOST=0.0.0.0 \
    GPT2_PORT=8000

# torch first, alone, from TORCH_INDEX_URL (its own layer: it changes least and weighs most).
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/gpt2-server
COPY pyproject.toml README* ./
COPY model ./model
COPY server ./server
COPY scripts ./scripts
# The package and its other dependencies from PyPI (no test extras); torch is satisfied already.
RUN pip install --no-cache-dir . \
    && rm -rf build ./*.egg-info

# Our CPU matrix kernels (model/kernels), compiled once here into GPT2_KERNEL_CACHE with a compiler that the
# same layer removes again (the library needs only the OpenMP runtime that torch ships): every build (AVX2,
# AVX-512, AVX-512 with VNNI), so that the image runs at its best on whichever x86-64 host it lands on. They
# are x86-64 code (g++ refuses -mavx2 elsewhere): an image for another CPU (docker build --platform
# linux/arm64) compiles none, and the model runs on torch's own kernels there.
ENV GPT2_KERNEL_CACHE=/opt/gpt2-kernels
# hadolint ignore=DL3008
RUN if [ "$(uname -m)" = x86_64 ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends g++ \
        && python -c "from model import kernels; [print(kernels.build(isa=isa)) for isa in kernels.ISAS]" \
        && apt-get purge -y --auto-remove g++ \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# A numeric non-root user (so that Kubernetes' runAsNonRoot can check it) owning the weight cache.
RUN groupadd --gid 10001 app \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /data --shell /usr/sbin/nologin app \
    && mkdir -p /data/hf \
    && chown -R 10001:10001 /data
USER 10001:10001
VOLUME ["/data/hf"]

EXPOSE 8000
# 503 while the model loads (a first run downloads it: hence the long start period), 200 once it serves.
HEALTHCHECK --interval=30s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; h = os.environ.get('GPT2_HOST') or '0.0.0.0'; h = {'0.0.0.0': '127.0.0.1', '::': '::1'}.get(h, h); h = '[' + h + ']' if ':' in h else h; urllib.request.urlopen('http://' + h + ':' + os.environ.get('GPT2_PORT', '8000') + '/health', timeout=4)"]

ENTRYPOINT ["gpt2-serve"]
