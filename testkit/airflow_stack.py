"""The real Airflow stack for a test module: api-server, scheduler, dag-processor (and, unless
left out, triggerer) on free ports, with the S3 and MLflow fixtures' servers as the tasks'
``aws_default`` and ``mlflow_default`` connections (as ``python -m infra.services up`` sets
them: no AWS or MLflow variable reaches a component). Every component runs in its own process
group and is stopped, group and all, on the way out."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from common.procs import Watch
from infra.airflow_client import wait_for_dag
from infra.airflow_service import AIRFLOW_COMPONENTS, start_airflow, stop_airflow
from infra.stack_config import StackConfig, connections_env
from testkit.waits import wait_for


@contextlib.contextmanager
def airflow_stack(home: Path, s3_server: Any, mlflow_server: Any, dags: Mapping[str, str], *,
                  extra_env: Mapping[str, str] | None = None,
                  components: Iterable[str] = AIRFLOW_COMPONENTS,
                  dags_folder: Path | None = None) -> Iterator[StackConfig]:
    """Start the stack, wait (bounded) until every DAG of ``dags`` (dag_id → file) is parsed.
    ``dags_folder``: where the dag-processor looks (the repository's ``dags/`` unless given)."""
    cfg = StackConfig.with_free_ports(home, **({"dags_folder": dags_folder} if dags_folder else {}))
    handles = start_airflow(cfg, client_env=stack_client_env(home, s3_server, mlflow_server, extra_env),
                            components=components)
    try:
        for dag_id, dag_file in dags.items():
            wait_for_dag(cfg.airflow_url, dag_id, timeout_s=180, dag_file=dag_file)
        yield cfg
    finally:
        assert stop_airflow(handles)
        Watch(sessions=[h.pgid for h in handles]).check("the Airflow stack")


def stack_client_env(home: Path, s3_server: Any, mlflow_server: Any,
                     extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the stack's tasks find in their environment: the S3 and MLflow connections, no AWS or
    MLflow variable of their own."""
    return {**connections_env(s3_endpoint=s3_server.endpoint, access_key=s3_server.access_key,
                              secret_key=s3_server.secret_key, mlflow_uri=mlflow_server.tracking_uri),
            "MXPIPE_ARTIFACT_ROOT": s3_server.env["MXPIPE_ARTIFACT_ROOT"],
            "MXPIPE_HOME": str(home), "MXPIPE_SCHEDULE": "none", "MXPIPE_RETRY_DELAY_S": "1",
            **(extra_env or {})}


@contextlib.contextmanager
def killed_and_restarted(cfg: StackConfig, client_env: Mapping[str, str], components: Iterable[str]) -> Iterator[None]:
    """``kill -9`` every process of the named components (their whole sessions: executor workers
    and task processes too), start them again, and stop the new ones on the way out: the stack
    then lacks those components, so a module uses this in its last test."""
    import signal

    from common.procs import group_members
    from infra.processes import load_handle

    killed = []
    for comp in components:
        handle = load_handle(cfg.home, f"airflow-{comp}")
        if handle is not None and handle.may_be_ours():
            killed.append(handle.pgid)
            for proc in group_members([handle.pgid], sessions=True):
                with contextlib.suppress(OSError):
                    proc.send_signal(signal.SIGKILL)
    # The leaders gone, so start_airflow launches fresh ones instead of reusing them.
    wait_for(lambda: not group_members(killed, sessions=True), timeout_s=30, what="the killed Airflow components gone")
    handles = start_airflow(cfg, client_env=client_env, components=components)
    try:
        yield
    finally:
        assert stop_airflow(handles)
        Watch(sessions=[h.pgid for h in handles]).check("the restarted Airflow components")


def wait_until_parked(home: Path, run_id: str, task_id: str, timeout_s: float = 180.0) -> None:
    """Wait until the scheduler has taken in the end of the attempt that parked ``task_id`` in
    ``awaiting_input`` (its "TaskInstance Finished ... state=awaiting_input" line).

    Seen here (Airflow 3.3.2): an answer that comes before that re-queues the task, the
    scheduler then takes the pausing attempt's "success" executor event for the new attempt and
    fails the task. Under load that window lasted more than 5 s after the API showed
    ``awaiting_input``; a person never answers that fast, a test does. ``home``: the folder of
    the scheduler's launch record, its output in ``logs/`` (a stack's home; a topology host's
    ``infra.topology.host_records``).
    """
    log_file = home / "logs" / "airflow-scheduler.log"
    wanted = f"task_id={task_id}, run_id={run_id},"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_file.read_text(errors="replace") if log_file.exists() else ""
        if any("TaskInstance Finished" in ln and wanted in ln and "state=awaiting_input" in ln
               for ln in text.splitlines()):
            return
        time.sleep(1)
    raise TimeoutError(f"{task_id} of {run_id}: the scheduler did not record the pause within {timeout_s:.0f}s")
