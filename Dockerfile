# syntax=docker/dockerfile:1
#
# tool-proxy container image: `docker build -t tool-proxy:0.1.0 .`
#
# Two stages: `build` installs the package into a virtualenv; the runtime stage copies only
# that virtualenv onto the same slim Python base (no compiler, pip, setuptools or caches).
# The base is pinned to a Python patch release and a Debian release; pin it by digest too
# in your build (PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:...). Both stages must use
# the same base: the virtualenv refers to /usr/local/bin/python3.11.
#
# The image runs as UID/GID 10001 and writes only to /var/lib/tool-proxy (the SQLite store)
# and /tmp, so it runs with a read-only root file system (docker run --read-only, or
# readOnlyRootFilesystem in Kubernetes) when those two are volumes.
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the package build reads (pyproject.toml names README.md as the readme).
COPY pyproject.toml README.md ./
COPY proxy ./proxy
# Install (pip compiles the bytecode: the runtime never writes .pyc files), then take pip
# and setuptools back out of the virtualenv. EXTRAS are the package's optional parts:
# `otel` by default, so the OTEL_* variables turn traces on in the image as they do
# elsewhere (docs/tracing.md); `--build-arg EXTRAS=` builds without them.
ARG EXTRAS=otel
RUN python -m venv /opt/venv \
    && /opt/venv/bin/python -m pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" \
    && /opt/venv/bin/python -m pip uninstall --yes pip setuptools

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="tool-proxy" \
      org.opencontainers.image.description="An idempotent reverse proxy for the HTTP tool APIs that AI agents call" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed, numeric non-root user: Kubernetes' runAsNonRoot can check it, and volume
# permissions (fsGroup 10001) match it.
RUN groupadd --system --gid 10001 toolproxy \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin toolproxy \
    && mkdir -p /var/lib/tool-proxy /etc/tool-proxy \
    && chown 10001:10001 /var/lib/tool-proxy

COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TOOL_PROXY_CONFIG=/etc/tool-proxy/config.yaml \
    TOOL_PROXY_HEALTHCHECK_URL=http://127.0.0.1:8080/_proxy/healthz

USER 10001:10001
WORKDIR /var/lib/tool-proxy
EXPOSE 8080
VOLUME ["/var/lib/tool-proxy", "/tmp"]

# For Docker and Compose (Kubernetes uses the chart's probes instead). The image has no
# curl: Python asks. Set TOOL_PROXY_HEALTHCHECK_URL when the proxy listens on another port.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['TOOL_PROXY_HEALTHCHECK_URL'], timeout=2)"]

# Mount the configuration at $TOOL_PROXY_CONFIG (or pass --config FILE); more flags
# (--port, --workers, --log-level) go after the image name.
ENTRYPOINT ["tool-proxy", "serve"]
