# The FleetBroker control plane: `fleet up` (embedded redis-server unless FLEET_REDIS_URL names
# one, the scheduler, the actuator, the API), configured from the environment (docs/deployment.md).
# Build from the repository root:  docker build -f infra/docker/broker.Dockerfile -t fleetbroker .
# Secrets are given at run time, never built in: FLEET_ADMIN_TOKEN, FLEET_AGENT_TOKEN,
# FLEET_METRICS_TOKEN, FLEET_TEAM_TOKENS, FLEET_REDIS_URL (e.g. docker run --env-file).

# The wheel is built where a C compiler is (the allocator's inner loop, policies/_maxplus.c).
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

FROM python:3.11-slim-bookworm
# redis-server: the embedded state store when no managed Redis is given
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --create-home --home-dir /var/lib/fleetbroker fleet
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/*.whl)[aws,gcp,azure]" && rm -rf /wheels
COPY examples/fleets /opt/fleetbroker/fleets
ENV FLEET_HOST=0.0.0.0 \
    FLEET_PORT=8470 \
    FLEET_STATE_DIR=/var/lib/fleetbroker/state \
    FLEET_FILE=/opt/fleetbroker/fleets/local.yaml \
    FLEET_LOG_FORMAT=json \
    FLEET_LOG_LEVEL=info \
    PYTHONUNBUFFERED=1
USER fleet
WORKDIR /var/lib/fleetbroker
VOLUME ["/var/lib/fleetbroker/state"]
EXPOSE 8470
HEALTHCHECK --interval=30s --timeout=5s \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ['FLEET_PORT'] + '/healthz', timeout=3)"]
ENTRYPOINT ["fleet", "up"]
