"""The embedded servers of a test stack: a SeaweedFS S3 gateway and an MLflow tracking server on
free 127.0.0.1 ports in a folder of their own, with fresh random credentials, each stopped with
its whole process group on the way out (an error names any process left behind).

The session fixtures of ``tests/conftest.py`` and the benchmarks' ``dag_services`` both run on
these; the fixtures add the environment a test process reads (``pytest.MonkeyPatch``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.stack_config import StackConfig


@dataclass
class S3Server:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    env: dict[str, str]  # the stack's AWS_* variables and MXPIPE_ARTIFACT_ROOT
    config: StackConfig  # the stack (ports, home)
    handle: Any = field(repr=False)  # common.procs.GroupRecord


@dataclass
class MLflowServer:
    tracking_uri: str
    handle: Any = field(repr=False)


def new_stack(home: Path) -> StackConfig:
    """A stack under ``home`` on free ports, saved (its credentials created)."""
    cfg = StackConfig.with_free_ports(home)
    cfg.save()
    return cfg


@contextlib.contextmanager
def running_s3(cfg: StackConfig) -> Iterator[S3Server]:
    """A real SeaweedFS S3 gateway of ``cfg`` with its credentials enforced."""
    from infra.s3_service import start_s3, stop_s3
    from infra.stack_config import load_credentials, stack_env

    handle = start_s3(cfg)
    try:
        creds = load_credentials(cfg.home)
        env = {k: v for k, v in stack_env(cfg.home).items() if k.startswith("AWS_") or k == "MXPIPE_ARTIFACT_ROOT"}
        yield S3Server(endpoint=cfg.s3_endpoint, bucket=cfg.bucket, access_key=creds["access_key"],
                       secret_key=creds["secret_key"], env=env, config=cfg, handle=handle)
    finally:
        if not stop_s3(handle):
            raise RuntimeError(f"SeaweedFS left processes behind: {handle.processes()}")


@contextlib.contextmanager
def running_mlflow(cfg: StackConfig) -> Iterator[MLflowServer]:
    """A real ``mlflow server`` of ``cfg`` (SQLite backend, artifacts proxied to its S3)."""
    from infra.services import start_mlflow

    handle = start_mlflow(cfg)
    try:
        yield MLflowServer(tracking_uri=cfg.mlflow_uri, handle=handle)
    finally:
        if not handle.stop():
            raise RuntimeError(f"mlflow server left processes behind: {handle.processes()}")
