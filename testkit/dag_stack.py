"""The real training DAG against a stack of its own, for benchmarks that measure whole runs.

``local_stack`` starts a SeaweedFS S3 server and an MLflow server on free ports under a folder
(``testkit/dag_services.py``), migrates an Airflow database there and yields the environment a run needs; ``run_dag`` runs the
``mxnet_training`` DAG in a child process with ``dag.test()`` (``testkit.dag_runs``) (Airflow's own task runner and
retries, the local cluster backend) and returns the run's state, run id and task tries.
``benchmarks/recovery.py`` (P4) and ``benchmarks/goodput.py`` (G1) both run on it.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from testkit import REPO
from testkit import dag_runs
from testkit.dag_runs import airflow_env
from testkit.dag_services import embedded_services

DIGITS = ("import sys; from common import storage; from testkit.digits import digits_csv; "
          "storage.put_bytes(sys.argv[1], digits_csv())")


@contextlib.contextmanager
def local_stack(root: Path, *, artifact_prefix: str, retry_delay_s: float) -> Iterator[tuple[dict[str, str], str]]:
    """S3 + MLflow (``embedded_services``) and an Airflow database under ``root``; yields the
    environment of a DAG run and the bucket."""
    with embedded_services(root) as (cfg, services):
        env = airflow_env(root / "home", migrate_timeout_s=600, **services, AIRFLOW_HOME=str(root / "airflow"),
                          MXPIPE_ARTIFACT_ROOT=f"s3://{cfg.bucket}/{artifact_prefix}",
                          MXPIPE_RETRY_DELAY_S=str(retry_delay_s))
        # A generic endpoint would send every AWS service (not only S3) to the local gateway.
        env.pop("AWS_ENDPOINT_URL", None)
        yield env, cfg.bucket


def run_dag(env: dict[str, str], conf: dict[str, Any], *, timeout_s: float, log: Path | None = None) -> dict[str, Any]:
    """One ``dag.test()`` run of the training DAG (its output also to ``log``): state, run id and
    tasks; raises with the output's tail if it did not finish."""
    result, logs = dag_runs.run_dag(env, conf, timeout=timeout_s)
    if log is not None:
        log.write_text(logs)
    return {k: result[k] for k in ("state", "run_id", "tasks")}


def upload(env: dict[str, str], uri: str, code: str = DIGITS, *args: str) -> None:
    """Run ``code`` (a snippet that writes the dataset to ``sys.argv[1]``) with the stack's S3."""
    subprocess.run([sys.executable, "-c", code, uri, *args], env=env, check=True, timeout=900, cwd=REPO)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The supervisor's event log (``MXPIPE_EVENTS_FILE``), one dict per line."""
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
