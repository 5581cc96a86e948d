"""The git sha tagged on the MLflow run: from MXPIPE_GIT_SHA, else this checkout's HEAD."""
import subprocess

import pytest

pytestmark = pytest.mark.unit


def test_env_wins_then_checkout_head(monkeypatch):
    from common.version import git_sha

    monkeypatch.setenv("MXPIPE_GIT_SHA", "abc123")
    assert git_sha() == "abc123"
    monkeypatch.delenv("MXPIPE_GIT_SHA")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    assert git_sha() == head and len(head) == 40
