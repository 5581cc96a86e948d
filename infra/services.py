"""The local service stack: SeaweedFS (S3), an MLflow tracking server and Airflow 3.

``python -m infra.services up|down|status|env`` manages the demo stack; the test fixtures use the
same functions on free ports in a temp folder. All state lives under one folder, ``$MXPIPE_HOME``
or ``<repo>/.local``::

    credentials.json   S3 key pair + Airflow secrets, mode 0600, generated once
    stack.json         ports and bucket of this home (written on first ``up``)
    run/<name>.json    one pid file per service: pid, process group, start time, port, log
    logs/<name>.log    stdout+stderr of each service
    s3/                SeaweedFS data        mlflow/mlflow.db    MLflow backend store
    airflow/           AIRFLOW_HOME (SQLite metadata DB, task logs)

The Airflow components get S3 and MLflow as the connections ``aws_default`` and
``mlflow_default`` (``AIRFLOW_CONN_*`` in their environment, ``stack_config.airflow_task_env``),
not as AWS or MLflow variables; ``env`` prints the plain variables for a shell.

The pieces: ``infra.stack_config`` (home, ports, credentials, environments),
``infra.processes`` (launch/stop of a service's session, pid files, bounded waits),
``infra.s3_service`` (SeaweedFS) and ``infra.airflow_service`` (Airflow). MLflow is small
enough to live here.

Trap (measured on this 2-core machine): MLflow runs ``--workers 1`` (uvicorn in-process) and
``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``, which stops it from spawning huey consumers (GenAI
job runner; not used here).
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from pathlib import Path

from common.cli import parser as cli_parser
from common.procs import GroupRecord
from infra.airflow_service import AIRFLOW_COMPONENTS, airflow_env, start_airflow
from infra.processes import http_get, launch, load_handle, running_handle, stop_all, wait_http
from infra.s3_service import start_s3, stop_s3
from infra.stack_config import (
    BIN_DIR,
    HOST,
    REGION,
    ServiceError,
    StackConfig,
    airflow_task_env,
    check_ports_free,
    load_credentials,
    mxpipe_home,
    service_env,
    stack_env,
)

SERVICES = ("s3", "mlflow", "airflow")


def start_mlflow(cfg: StackConfig, *, timeout_s: float = 180.0, workers: int = 1) -> GroupRecord:
    """``mlflow server`` with a SQLite backend and artifacts proxied to S3."""
    creds = load_credentials(cfg.home)
    check_ports_free([cfg.mlflow_port], "mlflow")
    db_dir = cfg.home / "mlflow"
    db_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(BIN_DIR / "mlflow"), "server",
           "--backend-store-uri", f"sqlite:///{db_dir / 'mlflow.db'}",
           "--artifacts-destination", f"s3://{cfg.bucket}/mlflow-artifacts",
           "--host", HOST, "--port", str(cfg.mlflow_port), "--workers", str(workers)]
    env = service_env({
        "MLFLOW_S3_ENDPOINT_URL": cfg.s3_endpoint,
        "AWS_ACCESS_KEY_ID": creds["access_key"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
        "AWS_DEFAULT_REGION": REGION,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    })
    handle = launch("mlflow", cmd, env, cfg.home, port=cfg.mlflow_port)
    try:
        wait_http(f"{cfg.mlflow_uri}/health", timeout_s, handle=handle, interval_s=1.0)
    except BaseException:
        handle.stop()
        raise
    return handle


# ---------------------------------------------------------------------------------------------
# the stack (CLI)


def _handles(home: Path, only: Iterable[str]) -> list[tuple[str, GroupRecord | None]]:
    names = []
    for svc in only:
        names += [f"airflow-{c}" for c in AIRFLOW_COMPONENTS] if svc == "airflow" else [svc]
    return [(n, load_handle(home, n)) for n in names]


def up(cfg: StackConfig, only: Iterable[str] = SERVICES, echo: Callable[[str], None] = print) -> None:
    """Start the stack (reusing whatever already runs for this home)."""
    cfg.home.mkdir(parents=True, exist_ok=True)
    cfg.save()
    load_credentials(cfg.home)
    only = [s for s in SERVICES if s in set(only)]
    for svc in only:
        t0 = time.monotonic()
        if svc == "s3":
            if running_handle(cfg.home, "s3"):
                echo(f"s3      already running at {cfg.s3_endpoint}")
                continue
            start_s3(cfg)
            echo(f"s3      up at {cfg.s3_endpoint} (bucket {cfg.bucket}) in {time.monotonic() - t0:.1f}s")
        elif svc == "mlflow":
            if running_handle(cfg.home, "mlflow"):
                echo(f"mlflow  already running at {cfg.mlflow_uri}")
                continue
            echo("mlflow  starting (the first start can take minutes here) ...")
            start_mlflow(cfg)
            echo(f"mlflow  up at {cfg.mlflow_uri} in {time.monotonic() - t0:.1f}s")
        elif svc == "airflow":
            running = [c for c in AIRFLOW_COMPONENTS if running_handle(cfg.home, f"airflow-{c}")]
            if len(running) == len(AIRFLOW_COMPONENTS):
                echo(f"airflow already running at {cfg.airflow_url}")
                continue
            echo(f"airflow starting {', '.join(c for c in AIRFLOW_COMPONENTS if c not in running)} "
                 "(and db migrate on first start) ...")
            start_airflow(cfg)
            echo(f"airflow up at {cfg.airflow_url} in {time.monotonic() - t0:.1f}s "
                 "(all users are admin; no login)")


def down(home: Path, only: Iterable[str] = SERVICES, echo: Callable[[str], None] = print) -> bool:
    ok = True
    for svc in reversed([s for s in SERVICES if s in set(only)]):
        handles = [h for _, h in _handles(home, [svc]) if h is not None]
        if svc == "s3":
            stopped = all(stop_s3(h) for h in handles)
        else:
            stopped = stop_all(handles)
        ok &= stopped
        if handles:
            echo(f"{svc:<8} {'stopped' if stopped else 'FAILED to stop (see logs)'}")
    return ok


def status(home: Path, echo: Callable[[str], None] = print) -> None:
    cfg = StackConfig.load(home)
    probes = {"s3": f"{cfg.s3_endpoint}/healthz", "mlflow": f"{cfg.mlflow_uri}/health",
              "airflow-api-server": f"{cfg.airflow_url}/api/v2/monitor/health"}
    echo(f"home {cfg.home}")
    for name, handle in _handles(home, SERVICES):
        if handle is None:
            echo(f"{name:<22} not started")
            continue
        state = "running" if handle.is_running() else "DEAD (stale pid file)"
        health = ""
        if handle.is_running() and name in probes:
            try:
                code, _ = http_get(probes[name], timeout_s=3)
                health = f" http {code}"
            except OSError as exc:
                health = f" unreachable ({exc})"
        port = f" port {handle.port}" if handle.port else ""
        echo(f"{name:<22} {state} pid {handle.pid}{port}{health}  log {handle.log_path}")


EXAMPLES = """
python -m infra.services up                      # start S3, MLflow and Airflow (or find them running)
python -m infra.services status
eval "$(python -m infra.services env)"           # use the stack's S3 and MLflow from this shell
python -m infra.services down --only airflow
"""


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser(__doc__.split("\n")[0] + " All state lives under one folder ($MXPIPE_HOME or <repo>/.local).",
                        EXAMPLES, prog="python -m infra.services")
    parser.add_argument("--home", help="state folder (default $MXPIPE_HOME or <repo>/.local)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start s3 → mlflow → airflow (idempotent)")
    p_up.add_argument("--only", default=",".join(SERVICES), help="comma list of s3,mlflow,airflow")
    p_up.add_argument("--free-ports", action="store_true",
                      help="on first up of this home, pick free ports instead of the defaults")
    for f in fields(StackConfig):
        if f.name.endswith("_port") or f.name == "bucket":
            p_up.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=None)
    p_down = sub.add_parser("down", help="stop the services of this home")
    p_down.add_argument("--only", default=",".join(SERVICES))
    sub.add_parser("status", help="show each service")
    p_env = sub.add_parser("env", help="print export lines for clients")
    p_env.add_argument("--airflow", action="store_true",
                       help="also the AIRFLOW__* config and the stack's connections (AIRFLOW_CONN_*)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    home = mxpipe_home(args.home)

    if args.cmd == "up":
        cfg = StackConfig.load(home)
        if args.free_ports and not (home / "stack.json").exists():
            cfg = StackConfig.with_free_ports(home)
        overrides = {f.name: getattr(args, f.name) for f in fields(StackConfig)
                     if getattr(args, f.name, None) is not None}
        cfg = replace(cfg, **overrides)
        try:
            up(cfg, [s.strip() for s in args.only.split(",") if s.strip()])
        except (ServiceError, TimeoutError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "down":
        return 0 if down(home, [s.strip() for s in args.only.split(",")]) else 1
    if args.cmd == "status":
        status(home)
        return 0
    env = stack_env(home)
    if args.airflow:
        cfg = StackConfig.load(home)
        env.update(airflow_task_env(home))
        env.update(airflow_env(home, api_port=cfg.airflow_port, dags_folder=cfg.dags_folder,
                               plugins_folder=cfg.plugins_folder))
    import shlex

    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
