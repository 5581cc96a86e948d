"""Airflow 3 for the local stack: its configuration as environment variables, the DB migration,
and the four components as processes of their own.

Choices and traps (measured on this 2-core machine): the four components run as separate
processes (``api-server``, ``scheduler``, ``dag-processor``, ``triggerer``), not ``airflow
standalone``: standalone runs the same four as threads-with-subprocesses of one parent, gives
no per-component logs or pid files, binds the API to 0.0.0.0 and starts the log servers (ports
8793/8794 on all interfaces, which collide between two stacks). Here the scheduler and
triggerer run with ``--skip-serve-logs`` (the LocalExecutor writes task logs to local disk,
which the API server reads directly; with the artifact root in S3 they are uploaded to
``s3://<bucket>/airflow-logs/`` as well, Airflow's remote logging, and read back from there:
``remote_logging_conf``). ``AIRFLOW_HOME`` is ``<home>/airflow/`` (SQLite metadata
DB, task logs).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterable, Mapping
from typing import Any

from common.procs import GroupRecord
from common.settings import settings
from infra.processes import http_get, launch, running_handle, stop_all, wait_until
from infra.stack_config import (
    BIN_DIR,
    HOST,
    REPO_ROOT,
    AWS_CONN_ID,
    ServiceError,
    StackConfig,
    airflow_task_env,
    check_ports_free,
    load_credentials,
    mxpipe_home,
    service_env,
)

AIRFLOW_COMPONENTS = ("dag-processor", "scheduler", "triggerer", "api-server")
# Where in the artifact root's bucket the task logs go (``remote_logging_conf``).
AIRFLOW_LOGS_PREFIX = "airflow-logs"


def airflow_env(home: str | os.PathLike[str], *, api_port: int = 8080,
                dags_folder: str | os.PathLike[str] | None = None,
                plugins_folder: str | os.PathLike[str] | None = None,
                parallelism: int = 4, remote_log_folder: str = "",
                creds: Mapping[str, str] | None = None) -> dict[str, str]:
    """Everything Airflow needs, as ``AIRFLOW_HOME`` + ``AIRFLOW__SECTION__KEY`` variables.
    ``remote_log_folder`` (``s3://bucket/prefix``): the task logs go there too, through the Amazon
    provider's remote logging with the ``aws_default`` connection (``remote_logging_conf``).
    ``creds``: the Airflow secrets (default: ``home``'s ``credentials.json``, generated on first
    use); a deployment whose homes start empty passes its own, so nothing is written there."""
    root = mxpipe_home(home)
    af_home = root / "airflow"
    creds = load_credentials(root) if creds is None else creds
    base_url = f"http://{HOST}:{api_port}"
    pythonpath = [str(REPO_ROOT)] + [p for p in settings().pythonpath.split(os.pathsep) if p]
    conf = {
        ("core", "dags_folder"): str(dags_folder or REPO_ROOT / "dags"),
        ("core", "plugins_folder"): str(plugins_folder or REPO_ROOT / "plugins"),
        ("core", "load_examples"): "False",
        ("core", "executor"): "LocalExecutor",
        ("core", "parallelism"): str(parallelism),
        ("core", "auth_manager"):
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        ("core", "simple_auth_manager_all_admins"): "True",
        ("core", "execution_api_server_url"): f"{base_url}/execution/",
        ("core", "fernet_key"): creds["airflow_fernet_key"],
        # getfqdn() may ask a DNS server; nothing here may leave 127.0.0.1.
        ("core", "hostname_callable"): "socket.gethostname",
        ("database", "sql_alchemy_conn"): f"sqlite:///{af_home / 'airflow.db'}",
        ("api", "host"): HOST,
        ("api", "port"): str(api_port),
        ("api", "base_url"): base_url,
        ("api", "workers"): "1",
        ("api", "secret_key"): creds["airflow_api_secret_key"],
        ("api_auth", "jwt_secret"): creds["airflow_jwt_secret"],
        # A new DAG file is listed within 5 s and parsed right after; files re-parsed every 30 s.
        ("dag_processor", "refresh_interval"): "5",
        ("dag_processor", "min_file_process_interval"): "30",
        ("dag_processor", "parsing_processes"): "1",
        ("logging", "colored_console_log"): "False",
        **(remote_logging_conf(remote_log_folder) if remote_log_folder else {}),
    }
    env = {f"AIRFLOW__{s.upper()}__{k.upper()}": v for (s, k), v in conf.items()}
    env.update({"AIRFLOW_HOME": str(af_home), "PYTHONPATH": os.pathsep.join(pythonpath)})
    return env


def remote_logging_conf(folder: str) -> dict[tuple[str, str], str]:
    """Airflow's remote task logging to ``folder`` on S3 (the Amazon provider's ``S3RemoteLogIO``)
    with the stack's S3 connection, whose ``endpoint_url`` extra points the provider's S3 hook
    at the stack's SeaweedFS: each task's log (the task's own lines and its trigger's) is
    uploaded when the task (or the trigger) ends, and the API server reads it from there, so the
    UI shows it from any host. ``delete_local_logs`` stays off: while a task runs, the API server
    shows its log from the local file (a LocalExecutor's worker is this host)."""
    return {("logging", "remote_logging"): "True", ("logging", "remote_base_log_folder"): folder,
            ("logging", "remote_log_conn_id"): AWS_CONN_ID, ("logging", "delete_local_logs"): "False"}


def remote_log_folder(client_env: Mapping[str, str]) -> str:
    """``s3://<the artifact root's bucket>/airflow-logs``, or "" (no remote logging) when the
    artifact root is not in S3 or the tasks get no S3 connection."""
    root = client_env.get("MXPIPE_ARTIFACT_ROOT", "")
    if not root.startswith("s3://") or f"AIRFLOW_CONN_{AWS_CONN_ID.upper()}" not in client_env:
        return ""
    return f"s3://{root[len('s3://'):].split('/', 1)[0]}/{AIRFLOW_LOGS_PREFIX}"


def airflow_process_env(cfg: StackConfig, client_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every Airflow component: the ambient one cleaned (``service_env``),
    ``client_env`` for the tasks (default: the stack's connections, ``airflow_task_env``; no
    component needs S3 or MLflow itself, except for the task logs: ``remote_logging_conf``) and
    Airflow's configuration."""
    extra = dict(airflow_task_env(cfg.home) if client_env is None else client_env)
    extra.update(airflow_env(cfg.home, api_port=cfg.airflow_port, dags_folder=cfg.dags_folder,
                             plugins_folder=cfg.plugins_folder, remote_log_folder=remote_log_folder(extra)))
    return service_env(extra)


def airflow_migrate(cfg: StackConfig, env: Mapping[str, str], *, timeout_s: float = 600.0) -> None:
    """``airflow db migrate`` once per home and Airflow version (a marker file records it)."""
    from importlib.metadata import version

    marker = cfg.home / "airflow" / ".migrated"
    wanted = version("apache-airflow-core")
    if marker.exists() and marker.read_text().strip() == wanted:
        return
    (cfg.home / "airflow").mkdir(parents=True, exist_ok=True)
    handle = launch("airflow-db-migrate", [str(BIN_DIR / "airflow"), "db", "migrate"], env, cfg.home)
    try:
        rc = handle.wait(timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(f"airflow db migrate took over {timeout_s:.0f}s") from exc
    finally:
        handle.stop(timeout=10)
    if rc != 0:
        raise ServiceError(f"airflow db migrate failed (rc={rc}):\n{handle.log_tail()}")
    marker.write_text(wanted)


def airflow_health(base_url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    status, body = http_get(f"{base_url}/api/v2/monitor/health", timeout_s)
    if status != 200:
        raise ServiceError(f"health: HTTP {status}")
    return json.loads(body)


def _airflow_ready(base_url: str, components: Iterable[str], since: float) -> bool:
    """Healthy, and the heartbeats are from this start (the DB remembers the last run's jobs)."""
    from datetime import datetime

    health = airflow_health(base_url)
    if health["metadatabase"]["status"] != "healthy":
        return False
    for comp in components:
        key = comp.replace("-", "_")
        if key == "api_server":
            continue
        info = health.get(key) or {}
        beat = info.get(f"latest_{key}_heartbeat")
        if info.get("status") != "healthy" or not beat:
            return False
        if datetime.fromisoformat(beat).timestamp() < since - 5:
            return False
    return True


def start_airflow(cfg: StackConfig, *, client_env: Mapping[str, str] | None = None,
                  components: Iterable[str] = AIRFLOW_COMPONENTS,
                  timeout_s: float = 300.0) -> list[GroupRecord]:
    """Migrate the DB once, start each component in its own session, wait until healthy.

    ``client_env`` (what the tasks find in their environment) defaults to the stack's S3 and
    MLflow connections (:func:`airflow_task_env` of ``cfg.home``).
    Components already running for this home are reused.
    """
    components = list(components)
    env = airflow_process_env(cfg, client_env)
    airflow_migrate(cfg, env)
    since = 0.0  # heartbeats must be newer than the first launch (the DB keeps old jobs)
    handles: list[GroupRecord] = []
    try:
        for comp in components:
            name = f"airflow-{comp}"
            handle = running_handle(cfg.home, name)
            if handle is None:
                since = since or time.time()
                if comp == "api-server":
                    check_ports_free([cfg.airflow_port], name)
                cmd = [str(BIN_DIR / "airflow"), comp]
                if comp == "api-server":
                    cmd += ["--host", HOST, "--port", str(cfg.airflow_port)]
                if comp in ("scheduler", "triggerer"):
                    cmd.append("--skip-serve-logs")
                handle = launch(name, cmd, env, cfg.home,
                                port=cfg.airflow_port if comp == "api-server" else None)
            handles.append(handle)

        def ready() -> bool:
            for h in handles:
                if not h.is_running():
                    raise ServiceError(f"{h.name} exited; log tail:\n{h.log_tail()}")
            return _airflow_ready(cfg.airflow_url, components, since)

        wait_until(ready, timeout_s, "Airflow health (/api/v2/monitor/health)", interval_s=2.0)
    except BaseException as exc:
        for h in handles:
            h.stop(timeout=10)
        if isinstance(exc, ServiceError):
            raise
        if isinstance(exc, TimeoutError):
            tails = "\n".join(f"--- {h.name}\n{h.log_tail(15)}" for h in handles)
            raise TimeoutError(f"{exc}\n{tails}") from None
        raise
    return handles


def stop_airflow(handles: Iterable[GroupRecord], timeout: float = 30.0) -> bool:
    """Stop the components in parallel (the triggerer alone takes ~10 s to wind down)."""
    return stop_all(handles, timeout)

