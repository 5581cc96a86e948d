"""The one project-local folder that holds all runtime state (services, clusters, logs)."""
from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mxpipe_home() -> str:
    """``$MXPIPE_HOME`` or ``<repo>/.local`` (git-ignored)."""
    return os.path.abspath(os.environ.get("MXPIPE_HOME") or os.path.join(REPO_ROOT, ".local"))
