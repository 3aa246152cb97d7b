# The node agent and the job-side runtime (PyTorch): what a training node runs. The broker starts
# it with the FLEET_* contract in the environment (broker/runtime/__init__.py) and the job's
# command after "--":  docker run ... fleetbroker-agent -- python train.py
# Build from the repository root:  docker build -f infra/docker/agent.Dockerfile -t fleetbroker-agent .
# For GPUs pass a CUDA base image with CPython 3.11 (the wheel is built for it) as --build-arg BASE=...
ARG BASE=python:3.11-slim-bookworm

FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY broker broker
COPY policies policies
COPY providers providers
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[runtime]" && rm -rf /wheels \
 && useradd --system --uid 10001 --create-home --home-dir /work fleet
ENV PYTHONUNBUFFERED=1
USER fleet
WORKDIR /work
ENTRYPOINT ["python", "-m", "broker.runtime.agent"]
