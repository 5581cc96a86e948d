"""The embedded services a benchmark that runs the real DAG (``dag.test()``) needs: a SeaweedFS S3
server and an MLflow server on free ports in a folder of the benchmark's own, stopped on the way
out (``testkit.servers``), and the environment a DAG run reads them from (keys, endpoints)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from infra.stack_config import StackConfig
from testkit.servers import new_stack, running_mlflow, running_s3


@contextlib.contextmanager
def embedded_services(root: Path) -> Iterator[tuple[StackConfig, dict[str, str]]]:
    """Start S3 and MLflow under ``root/stack``; yields the stack config and the variables that
    point a process at them (AWS keys and S3 endpoint, ``MLFLOW_TRACKING_URI``)."""
    cfg = new_stack(root / "stack")
    with running_s3(cfg) as s3, running_mlflow(cfg) as mlflow:
        env = {k: v for k, v in s3.env.items() if k.startswith("AWS_")}
        env.update({"MLFLOW_TRACKING_URI": mlflow.tracking_uri, "AWS_ACCESS_KEY_ID": s3.access_key,
                    "AWS_SECRET_ACCESS_KEY": s3.secret_key})
        yield cfg, env


def use_in_this_process(env: dict[str, str]) -> None:
    """Point this process's S3 and MLflow clients at the services (the benchmark reads results)."""
    os.environ.update(env)
    # A generic endpoint would send every AWS service (not only S3) to the local gateway.
    os.environ.pop("AWS_ENDPOINT_URL", None)
