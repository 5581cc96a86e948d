"""The code version that trained a model (tagged on its MLflow run as ``mlflow.source.git.commit``)."""
from __future__ import annotations

import subprocess

from common.settings import REPO_ROOT, settings


def git_sha() -> str:
    """``MXPIPE_GIT_SHA`` (set in images, which carry no .git), else ``git rev-parse HEAD`` of
    this checkout, else "unknown"."""
    if sha := settings().git_sha:
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    head = out.stdout.strip()
    return head if out.returncode == 0 and head else "unknown"
