"""The real Airflow stack for a test module: api-server, scheduler, dag-processor (and, unless
left out, triggerer) on free ports, with the S3 and MLflow fixtures' settings for the tasks.
Every component runs in its own process group and is stopped, group and all, on the way out."""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from infra import services
from infra.airflow_client import wait_for_dag


@contextlib.contextmanager
def airflow_stack(home: Path, s3_server: Any, mlflow_server: Any, dags: Mapping[str, str], *,
                  extra_env: Mapping[str, str] | None = None,
                  components: Iterable[str] = services.AIRFLOW_COMPONENTS) -> Iterator[services.StackConfig]:
    """Start the stack, wait (bounded) until every DAG of ``dags`` (dag_id → file) is parsed."""
    cfg = services.StackConfig.with_free_ports(home)
    client_env = {**s3_server.env, "MLFLOW_TRACKING_URI": mlflow_server.tracking_uri,
                  "MXPIPE_HOME": str(home), "MXPIPE_SCHEDULE": "none", "MXPIPE_RETRY_DELAY_S": "1",
                  **(extra_env or {})}
    handles = services.start_airflow(cfg, client_env=client_env, components=components)
    try:
        for dag_id, dag_file in dags.items():
            wait_for_dag(cfg.airflow_url, dag_id, timeout_s=180, dag_file=dag_file)
        yield cfg
    finally:
        assert services.stop_airflow(handles)
        for handle in handles:
            assert services.group_processes(handle.pgid) == [], handle.name
