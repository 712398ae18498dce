# syntax=docker/dockerfile:1
#
# elastic-trainer image: one supervisor (`elastic-trainer launch ...`) per container/node.
#
#   docker build -t elastic-trainer:cuda .                      # default: CUDA runtime + CUDA torch
#   docker build -t elastic-trainer:cpu --build-arg VARIANT=cpu .  # CPU-only torch, small smoke image
#   docker build -t elastic-trainer:cuda-hf --build-arg EXTRAS=hf .  # + transformers, tokenizers, pyarrow
#                                                                    # (configs/llama-cluster.toml needs them)
#
# VARIANT picks the base stage below (base-cuda | base-cpu). CUDA_IMAGE / CPU_IMAGE pin the bases.

ARG VARIANT=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG CPU_IMAGE=python:3.12-slim-bookworm

# --- CUDA base: NVIDIA runtime libraries + distro Python in a venv + CUDA torch wheels from PyPI.
FROM ${CUDA_IMAGE} AS base-cuda
ARG TORCH_SPEC="torch>=2.13"
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# TORCH_SPEC is the pin (a build arg), which hadolint cannot see through.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "${TORCH_SPEC}"

# --- CPU base: slim Python + CPU-only torch (no CUDA libraries: ~1/10 of the size).
FROM ${CPU_IMAGE} AS base-cpu
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3013
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# --- Runtime: the package on top of the chosen base, run as an unprivileged user.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ARG UID=10001
# Optional extras of the package (pyproject [project.optional-dependencies]), e.g. "hf".
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/trainer
WORKDIR /opt/elastic-trainer
# Only what `pip install .` needs (see .dockerignore); torch is already satisfied by the base stage.
COPY pyproject.toml README.md ./
COPY elastic_trainer ./elastic_trainer
# ".[EXTRAS]" is the local package, which hadolint's pin check cannot tell from a PyPI name.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".${EXTRAS:+[${EXTRAS}]}" \
    && elastic-trainer --help > /dev/null \
    && groupadd --gid "${UID}" trainer \
    && useradd --create-home --home-dir /home/trainer --uid "${UID}" --gid "${UID}" --shell /usr/sbin/nologin trainer \
    && mkdir -p /workspace \
    && chown "${UID}:${UID}" /workspace
WORKDIR /workspace
USER ${UID}:${UID}
# 9400: Prometheus /metrics; 29400: c10d rendezvous store (served by the rendezvous host node).
EXPOSE 9400 29400
# Kubernetes ignores HEALTHCHECK; liveness is the supervisor's own hang timeout (elastic.hang_timeout_seconds).
HEALTHCHECK NONE
ENTRYPOINT ["elastic-trainer"]
CMD ["--help"]
