#!/usr/bin/env bash
# Installs the locked environment into .venv (idempotent). Needs only python3.11 and network
# access to PyPI. uv resolves nothing here: it installs exactly what uv.lock pins.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.8
if ! command -v uv >/dev/null 2>&1 || [ "$(uv --version | awk '{print $2}')" != "$UV_VERSION" ]; then
  python3 -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
stamp=.venv/.synced
if [ -f "$stamp" ] && [ "$stamp" -nt uv.lock ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
echo "==> installing the locked environment into .venv (first time: a few minutes)"
# Bytecode is compiled up front: the environment may set PYTHONDONTWRITEBYTECODE, and without
# .pyc files every role process would compile mxnet/airflow/mlflow from source at each start.
uv sync --frozen --python 3.11 --compile-bytecode
touch "$stamp"
