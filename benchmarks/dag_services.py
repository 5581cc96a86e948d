"""The embedded services a benchmark that runs the real DAG (``dag.test()``) needs: a SeaweedFS S3
server and an MLflow server on free ports in a folder of the benchmark's own, stopped on the way
out, and the environment a DAG run reads them from (keys, endpoints, its own AIRFLOW_HOME)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from infra.stack_config import StackConfig


@contextlib.contextmanager
def embedded_services(root: Path) -> Iterator[tuple[StackConfig, dict[str, str]]]:
    """Start S3 and MLflow under ``root/stack``; yields the stack config and the variables that
    point a process at them (AWS keys and S3 endpoint, ``MLFLOW_TRACKING_URI``)."""
    from infra.s3_service import start_s3, stop_s3
    from infra.services import start_mlflow
    from infra.stack_config import load_credentials, stack_env

    cfg = StackConfig.with_free_ports(root / "stack")
    cfg.save()
    s3 = start_s3(cfg)
    mlflow = None
    try:
        mlflow = start_mlflow(cfg)
        creds = load_credentials(cfg.home)
        env = {k: v for k, v in stack_env(cfg.home).items() if k.startswith("AWS_") or k == "MLFLOW_TRACKING_URI"}
        env.update({"AWS_ACCESS_KEY_ID": creds["access_key"], "AWS_SECRET_ACCESS_KEY": creds["secret_key"]})
        yield cfg, env
    finally:
        if mlflow is not None:
            mlflow.stop()
        stop_s3(s3)


def use_in_this_process(env: dict[str, str]) -> None:
    """Point this process's S3 and MLflow clients at the services (the benchmark reads results)."""
    os.environ.update(env)
    # A generic endpoint would send every AWS service (not only S3) to the local gateway.
    os.environ.pop("AWS_ENDPOINT_URL", None)
