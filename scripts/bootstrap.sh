#!/usr/bin/env bash
# Installs the locked environment into .venv (idempotent). Needs only python3.11 and network
# access to PyPI. uv resolves nothing here: it installs exactly what uv.lock pins.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.8
if ! command -v uv >/dev/null 2>&1 || [ "$(uv --version | awk '{print $2}')" != "$UV_VERSION" ]; then
  python3 -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
# System tools some tests use, installed only where missing and only as root (CI runs as root
# on a fresh machine): iproute2 for the network-namespace hosts of the hosts-backend tests (and
# tc for their constrained links), openssh-server and its client for the SSH transport between
# those hosts, nftables for packet loss on their links, and a Compose client to validate
# docker/compose.yaml without a Docker engine; Redis and PostgreSQL for the namespace topology
# (`make topology`, infra/topology.py). Without them those tests skip and say why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
  [ -x /usr/sbin/nft ] || missing+=(nftables)
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
  if ! command -v docker-compose >/dev/null 2>&1 && ! docker compose version >/dev/null 2>&1; then
    missing+=(docker-compose)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "==> installing ${missing[*]} (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || echo "warning: could not install ${missing[*]}; the tests that need them will skip"
  fi
fi
stamp=.venv/.synced
if [ -f "$stamp" ] && [ "$stamp" -nt uv.lock ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
echo "==> installing the locked environment into .venv (first time: a few minutes)"
# Bytecode is compiled up front: the environment may set PYTHONDONTWRITEBYTECODE, and without
# .pyc files every role process would compile mxnet/airflow/mlflow from source at each start.
# Groups: `dev` (default: the test tools), `local` (the embedded S3 server, the demo data) and
# `airflow-image` (CeleryExecutor and PostgreSQL: the scaled-out image and the namespace
# topology); `trainer` is a subset of the project's dependencies (see pyproject.toml).
uv sync --frozen --python 3.11 --compile-bytecode --group local --group airflow-image
touch "$stamp"
