"""The scaled-out deployment on network-namespace hosts of this machine, no containers.

``python -m infra.topology up|down|status|compose-env`` (``make topology`` / ``make
topology-down``). Every host is a network namespace on one bridge (``infra.netns``), reached from
this machine over an uplink veth, and its servers listen on its own address only. The layout
(``HOSTS``):

    db        PostgreSQL: Airflow's metadata database and MLflow's backend store (two databases)
    broker    Redis: Celery's broker
    s3        SeaweedFS (``weed mini``), the S3 store
    mlflow    the MLflow tracking server, artifacts in S3
    airflow   Airflow's API server, scheduler and DAG processor (CeleryExecutor)
    triggerer the triggerer
    worker1/2 a Celery worker each
    train1-3  sshd: the machines of the ``hosts`` backend (``etc/hosts.json``)

The folders of ``<root>``:

    hosts/<host>/    the host's home (``HOME``, ``MXPIPE_HOME`` under it, its servers' data); empty
                     when the host starts: whatever is in it, the host's own processes wrote
    etc/             the deployment's configuration, one copy for every host (read-only there):
                     the hosts list, the ssh client key and pinned host keys, each training host's
                     sshd files, PostgreSQL's pg_hba.conf
    records/<host>/  what this machine keeps of the host's servers, as a supervisor outside the
                     host would: their console output (logs/) and pid records (run/)
    credentials.json the secrets, generated once; the hosts get them in their environment

Each host's processes run in a mount namespace of their own (``host_command``) in which ``<root>``
holds only the host's own home and ``etc/``: a read of another host's file fails (no such file)
as it would between machines, while the checkout and its environment stay where they are. So
Airflow's configuration is all ``AIRFLOW__SECTION__KEY`` variables (``airflow_host_env``), and a
cluster record, a job's log or a task log reaches another host through S3, PostgreSQL or HTTP only.

Settings come from one place, ``TopologySettings`` (and the secrets generated once into
``<root>/credentials.json``); ``compose_env`` renders the same settings as the env file of
``docker/compose.yaml`` (``docker/env.example`` is that file with placeholder secrets, and a
test checks it is current). Programs come from Debian (postgres, redis-server, sshd, util-linux's
unshare and mount) and the project's environment (weed, mlflow, airflow). ``<root>/topology.json``
records what was brought up, so ``down`` stops exactly that: every server by its process group,
then every namespace and the uplink, and it fails naming any process that was still running in a
namespace.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from common.cli import parser as cli_parser
from common.procs import GroupRecord
from common.settings import Settings
from infra import netns
from infra.airflow_service import _airflow_ready, airflow_env
from infra.processes import http_get, launch, load_handle, stop_all, wait_until
from infra.s3_service import ensure_bucket, s3_client, stop_s3, weed_command
from infra.stack_config import (
    BIN_DIR,
    REGION,
    REPO_ROOT,
    ServiceError,
    StackConfig,
    _write_private,
    artifact_root,
    connections_env,
    load_credentials,
    mxpipe_home,
    service_env,
)

# Host name → last octet of its address on the topology's subnet (the uplink is .254).
HOSTS: dict[str, int] = {"db": 1, "broker": 2, "s3": 3, "mlflow": 4, "airflow": 5, "triggerer": 6,
                         "worker1": 7, "worker2": 8, "train1": 9, "train2": 10, "train3": 11}
UPLINK_HOST = 254
# Bounds of each start, measured loaded on this 2-core machine with a few times' margin.
START_TIMEOUT_S = {"postgres": 60.0, "redis": 30.0, "s3": 60.0, "mlflow": 300.0, "migrate": 600.0,
                   "airflow": 300.0, "worker": 300.0, "sshd": 30.0}
PLACEHOLDER = "change-me"
# Which environment variable a setting of the compose env file is (the rest are secrets).
COMPOSE_SETTINGS = {"postgres_user": "POSTGRES_USER", "airflow_db": "POSTGRES_DB", "mlflow_db": "MLFLOW_DB",
                    "bucket": "S3_BUCKET", "worker_concurrency": "AIRFLOW_WORKER_CONCURRENCY",
                    "retry_delay_s": "MXPIPE_RETRY_DELAY_S"}
COMPOSE_SECRETS = {"postgres_password": "POSTGRES_PASSWORD", "access_key": "S3_ACCESS_KEY",
                   "secret_key": "S3_SECRET_KEY", "airflow_fernet_key": "AIRFLOW_FERNET_KEY",
                   "airflow_jwt_secret": "AIRFLOW_JWT_SECRET", "airflow_api_secret_key": "AIRFLOW_API_SECRET_KEY"}


# The embedded stack's defaults (infra.stack_config.StackConfig, common.settings.Settings) that the
# topology keeps: its servers on their own addresses take the same ports, bucket and retry delay.
_STACK = {f.name: f.default for f in dataclasses.fields(StackConfig)}
_RETRY_DELAY_S = Settings.model_fields["retry_delay_s"].default


class TopologySettings(BaseModel):
    """The deployment's settings: names, ports, databases; shared with ``docker/compose.yaml``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefix: str = Field("mxt", pattern=r"^[a-z][a-z0-9]{0,5}$", description="namespace name prefix")
    subnet: str = Field("10.215.0", pattern=r"^\d+\.\d+\.\d+$", description="the bridge's /24")
    postgres_user: str = "airflow"
    airflow_db: str = "airflow"
    mlflow_db: str = "mlflow"
    postgres_port: int = 5432
    redis_port: int = 6379
    s3_port: int = _STACK["s3_port"]
    bucket: str = _STACK["bucket"]
    mlflow_port: int = _STACK["mlflow_port"]
    airflow_port: int = _STACK["airflow_port"]
    worker_concurrency: int = Field(2, ge=1)
    # Whole seconds: the compose env file has the value as written here.
    retry_delay_s: int = Field(int(_RETRY_DELAY_S), ge=0)
    task_heartbeat_timeout_s: int = Field(30, ge=10, description="[scheduler] task_instance_heartbeat_timeout")

    def address(self, host: str) -> str:
        return f"{self.subnet}.{HOSTS[host]}"

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def uplink(self) -> str:
        return f"{self.prefix}-up"

    @property
    def uplink_address(self) -> str:
        return f"{self.subnet}.{UPLINK_HOST}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.address('s3')}:{self.s3_port}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{self.address('mlflow')}:{self.mlflow_port}"

    @property
    def airflow_url(self) -> str:
        return f"http://{self.address('airflow')}:{self.airflow_port}"

    def postgres_uri(self, password: str, db: str, scheme: str = "postgresql+psycopg2") -> str:
        return f"{scheme}://{self.postgres_user}:{password}@{self.address('db')}:{self.postgres_port}/{db}"


def s3_env(settings: TopologySettings, creds: Mapping[str, str]) -> dict[str, str]:
    """The AWS variables of a client of the topology's S3 (boto3 and common.storage read them)."""
    return {"AWS_ENDPOINT_URL_S3": settings.s3_endpoint, "AWS_ACCESS_KEY_ID": creds["access_key"],
            "AWS_SECRET_ACCESS_KEY": creds["secret_key"], "AWS_DEFAULT_REGION": REGION}


def secrets(root: Path) -> dict[str, str]:
    """The deployment's secrets: the stack's (``load_credentials``) plus PostgreSQL's and Redis'
    passwords, generated once into ``<root>/credentials.json`` (mode 0600)."""
    import secrets as random

    creds = load_credentials(root)
    missing = {k: random.token_hex(16) for k in ("postgres_password", "redis_password") if k not in creds}
    if missing:
        creds = {**creds, **missing}
        _write_private(root / "credentials.json", json.dumps(creds, indent=2))
    return creds


def compose_env(settings: TopologySettings, creds: Mapping[str, str] | None = None) -> str:
    """The env file of ``docker/compose.yaml`` for ``settings`` (placeholder secrets without
    ``creds``): ``docker/env.example`` is ``compose_env(TopologySettings())``."""
    lines = ["# Generated by `python -m infra.topology compose-env` from infra.topology.TopologySettings",
             "# (the settings the namespace topology runs with). Copy to docker/.env and replace every",
             f"# {PLACEHOLDER} (docker/.env is git-ignored). The S3 key pair also goes into the Airflow",
             "# connection aws_default (compose.yaml): no '\"' or '\\' in it."]
    lines += [f"{var}={getattr(settings, field)}" for field, var in COMPOSE_SETTINGS.items()]
    lines += [f"{var}={(creds or {}).get(key, PLACEHOLDER)}" for key, var in COMPOSE_SECRETS.items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# hosts and their processes


def host_home(root: Path, host: str) -> Path:
    return root / "hosts" / host


def shared_config(root: Path) -> Path:
    """``<root>/etc``: the configuration every host reads (read-only on the hosts)."""
    return root / "etc"


def host_records(root: Path, host: str) -> Path:
    """This machine's records of ``host``'s servers: ``logs/<name>.log`` and ``run/<name>.json``
    (``infra.processes.launch``'s layout), outside the host's home and out of its sight."""
    return root / "records" / host


def _host_env(root: Path, settings: TopologySettings, host: str, extra: Mapping[str, str]) -> dict[str, str]:
    """The ambient environment cleaned (``service_env``), the host's own ``HOME``, ``MXPIPE_HOME``
    and ``TMPDIR`` (this machine's /tmp is one for every host: a temporary file goes to the home,
    which no other host sees), and a tag naming the topology (``leftovers`` looks for it)."""
    home = host_home(root, host)
    return service_env({"HOME": str(home), "MXPIPE_HOME": str(home / "mxpipe"), "TMPDIR": str(home / "tmp"),
                        "MXPIPE_TOPOLOGY": settings.prefix,
                        "MXPIPE_HOST_ADDRESS": settings.address(host), **extra})


# Run by ``host_command`` as root in the host's fresh mount namespace ($1 the topology's root, $2
# the host, then the command). A tmpfs is built up at <root>/.view with the host's home and etc/
# (read-only) bound into it, moved over <root> (so the other homes and this machine's records
# vanish) and made read-only: writing where another host's home was fails too. Then the command
# is exec'd, keeping the pid ``launch`` recorded. Mounts, not permissions: every host runs as root.
_HOST_VIEW = r"""set -e
root=$1 host=$2; shift 2
view="$root/.view"
mount -t tmpfs -o mode=0755,size=1m "topology-$host" "$view"
mkdir -p "$view/hosts/$host" "$view/etc"
mount --bind "$root/hosts/$host" "$view/hosts/$host"
mount --bind -o ro "$root/etc" "$view/etc"
mount --move "$view" "$root"
mount -o remount,ro,bind "$root"
mkdir -p "$root/hosts/$host/tmp"
cd "$root/hosts/$host"
exec "$@"
"""


def host_command(root: Path, settings: TopologySettings, host: str, cmd: list[str]) -> list[str]:
    """``cmd`` as a process of ``host``: in its network namespace (``ip netns exec``, which execs
    it) and a private mount namespace (``unshare``, which execs it too) where ``<root>`` shows the
    host's own home and ``etc/`` only (``_HOST_VIEW``). What the host's processes start (an ssh
    session of sshd, a Celery task) inherits both."""
    return ["ip", "netns", "exec", settings.namespace(host), "unshare", "--mount", "--propagation", "private",
            "sh", "-c", _HOST_VIEW, "host-view", str(root), host, *cmd]


def _launch(root: Path, settings: TopologySettings, host: str, name: str, cmd: list[str],
            env: Mapping[str, str], port: int | None = None) -> GroupRecord:
    """``cmd`` on ``host`` (``host_command``), its output and pid record in ``host_records``: the
    recorded session is the server's, since every step of the way execs the next."""
    return launch(name, host_command(root, settings, host, cmd), env, host_records(root, host), port=port,
                  cwd=host_home(root, host))


def _as_postgres(*cmd: str) -> list[str]:
    """PostgreSQL refuses to run as root: ``setpriv`` execs it as the ``postgres`` user (no
    forked parent, unlike su/runuser, so the session stays the server's)."""
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *cmd]


def _pg_bin(tool: str) -> str:
    found = shutil.which(tool) or next(iter(sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{tool}"))), None)
    if not found:
        raise ServiceError(f"{tool} not found (Debian: postgresql)")
    return str(found)


def start_postgres(root: Path, settings: TopologySettings, creds: Mapping[str, str]) -> GroupRecord:
    import pwd

    home = host_home(root, "db")
    data = home / "pgdata"
    user = pwd.getpwnam("postgres")
    # Who may connect comes with the configuration (etc/), not from a file written into the home.
    hba = shared_config(root) / "pg_hba.conf"
    hba.write_text(f"local all all scram-sha-256\nhost all all {settings.subnet}.0/24 scram-sha-256\n")
    if not (data / "PG_VERSION").exists():
        os.chown(home, user.pw_uid, user.pw_gid)
        # initdb on the db host, as PostgreSQL's user, the password through its own pipe: a
        # --pwfile in the home would be a file written there before the host started, and
        # /dev/stdin of a pipe root made is closed to that user.
        initdb = _launch(root, settings, "db", "initdb", _as_postgres(
            "sh", "-c", 'printf "%s\\n" "$PGPASSWORD" | "$@" --pwfile=/dev/stdin', "initdb", _pg_bin("initdb"),
            "-D", str(data), "-U", settings.postgres_user, "--auth=scram-sha-256", "-E", "UTF8"),
            _host_env(root, settings, "db", {"PGPASSWORD": creds["postgres_password"]}))
        try:
            rc = initdb.wait(120)
        finally:
            initdb.stop(timeout=10)
        if rc != 0:
            # Typically a parent folder the postgres user cannot enter (a mode-0700 temp folder).
            raise ServiceError(f"initdb as the postgres user failed in {data}:\n{initdb.log_tail()}")
    cmd = _as_postgres(_pg_bin("postgres"), "-D", str(data), "-c", f"listen_addresses={settings.address('db')}",
                       "-p", str(settings.postgres_port), "-c", f"unix_socket_directories={data}",
                       "-c", f"hba_file={hba}")
    handle = _launch(root, settings, "db", "postgres", cmd, _host_env(root, settings, "db", {}),
                     port=settings.postgres_port)

    # psql, not a Python driver: infra needs none of its own (Airflow's and MLflow's come with
    # the airflow-image group), and the client ships with the server's Debian packages.
    env = {"PGPASSWORD": creds["postgres_password"], "PGCONNECT_TIMEOUT": "3"}
    conninfo = f"host={settings.address('db')} port={settings.postgres_port} user={settings.postgres_user} dbname=postgres"

    def psql(sql: str) -> str:
        return subprocess.run([_pg_bin("psql"), conninfo, "-tAc", sql], env=env, capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()

    def ready() -> bool:
        for db in (settings.airflow_db, settings.mlflow_db):
            if psql(f"SELECT 1 FROM pg_database WHERE datname = '{db}'") != "1":
                psql(f'CREATE DATABASE "{db}"')
        return True

    wait_until(ready, START_TIMEOUT_S["postgres"], "PostgreSQL", handle=handle)
    return handle


def stop_postgres(root: Path, settings: TopologySettings, handle: GroupRecord) -> bool:
    """A fast shutdown first (``pg_ctl stop -m fast`` on the db host: the postmaster ends its
    children in order), then the session as every server's."""
    if handle.is_running():
        pg_ctl = _as_postgres(_pg_bin("pg_ctl"), "stop", "-D", str(host_home(root, "db") / "pgdata"), "-m", "fast",
                              "-t", "30")
        subprocess.run(host_command(root, settings, "db", pg_ctl), capture_output=True, timeout=60)
    return handle.stop(timeout=10)


def start_redis(root: Path, settings: TopologySettings, creds: Mapping[str, str]) -> GroupRecord:
    server = shutil.which("redis-server", path=netns.SBIN_PATH)
    if not server:
        raise ServiceError("redis-server not found (Debian: redis-server; scripts/bootstrap.sh installs it)")
    address = settings.address("broker")
    # No persistence: the broker's queue is rebuilt by the scheduler (Airflow re-queues tasks).
    cmd = [server, "--bind", address, "--port", str(settings.redis_port), "--save", "", "--appendonly", "no",
           "--dir", str(host_home(root, "broker")), "--requirepass", creds["redis_password"],
           "--daemonize", "no", "--supervised", "no"]
    handle = _launch(root, settings, "broker", "redis", cmd, _host_env(root, settings, "broker", {}),
                     port=settings.redis_port)

    cli = shutil.which("redis-cli") or "redis-cli"

    def ready() -> bool:
        # The password through the environment (REDISCLI_AUTH), not the command line.
        out = subprocess.run([cli, "-h", address, "-p", str(settings.redis_port), "ping"], capture_output=True,
                             text=True, timeout=10, env={"REDISCLI_AUTH": creds["redis_password"]})
        return out.stdout.strip() == "PONG"

    wait_until(ready, START_TIMEOUT_S["redis"], "Redis", handle=handle)
    return handle


def start_seaweedfs(root: Path, settings: TopologySettings, creds: Mapping[str, str]) -> GroupRecord:
    """``weed mini`` as the embedded stack runs it (``infra.s3_service.weed_command``), on the
    s3 host's address, with the deployment's key pair enforced."""
    cfg = StackConfig(home=host_home(root, "s3"), bucket=settings.bucket, s3_port=settings.s3_port,
                      s3_host=settings.address("s3"))
    env = _host_env(root, settings, "s3", {"AWS_ACCESS_KEY_ID": creds["access_key"],
                                           "AWS_SECRET_ACCESS_KEY": creds["secret_key"]})
    handle = _launch(root, settings, "s3", "s3", weed_command(cfg), env, port=settings.s3_port)
    client = s3_client(settings.s3_endpoint, creds["access_key"], creds["secret_key"])
    wait_until(lambda: client.list_buckets() is not None, START_TIMEOUT_S["s3"], "S3 list_buckets", handle=handle)
    ensure_bucket(settings.s3_endpoint, creds["access_key"], creds["secret_key"], settings.bucket)
    return handle


def start_mlflow(root: Path, settings: TopologySettings, creds: Mapping[str, str]) -> GroupRecord:
    cmd = [str(BIN_DIR / "mlflow"), "server",
           "--backend-store-uri", settings.postgres_uri(creds["postgres_password"], settings.mlflow_db),
           "--artifacts-destination", f"s3://{settings.bucket}/mlflow-artifacts",
           # MLflow 3 answers only requests whose Host it allows: by default localhost and private
           # addresses, which the bridge's are.
           "--host", settings.address("mlflow"), "--port", str(settings.mlflow_port), "--workers", "1"]
    env = _host_env(root, settings, "mlflow", {
        **s3_env(settings, creds), "MLFLOW_S3_ENDPOINT_URL": settings.s3_endpoint,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    handle = _launch(root, settings, "mlflow", "mlflow", cmd, env, port=settings.mlflow_port)
    wait_until(lambda: http_get(f"{settings.mlflow_uri}/health", 5)[0] == 200, START_TIMEOUT_S["mlflow"],
               "MLflow /health", handle=handle, interval_s=1.0)
    return handle


AIRFLOW_HOSTS = {"airflow": ("api-server", "scheduler", "dag-processor"), "triggerer": ("triggerer",),
                 "worker1": ("celery-worker",), "worker2": ("celery-worker",)}
WORKERS = ("worker1", "worker2")
TRAINING_HOSTS = ("train1", "train2", "train3")


def airflow_host_env(root: Path, settings: TopologySettings, creds: Mapping[str, str], host: str) -> dict[str, str]:
    """Airflow's configuration on ``host`` (``infra.airflow_service.airflow_env``, with the
    CeleryExecutor, PostgreSQL, Redis and the bridge addresses), and what its tasks find in
    their environment: the S3 and MLflow connections, the artifact root, the hosts file."""
    home = host_home(root, host)
    # The same secrets on every Airflow host (the JWTs one host signs, another checks), in the
    # environment as the rest: nothing is written into the home.
    env = airflow_env(home, api_port=settings.airflow_port, creds=creds)
    api = settings.airflow_url
    pg = creds["postgres_password"]
    conf = {
        ("core", "executor"): "CeleryExecutor",
        ("core", "parallelism"): str(2 * len(WORKERS) * settings.worker_concurrency),
        ("core", "execution_api_server_url"): f"{api}/execution/",
        # Every namespace shares this machine's hostname: a task log names its worker by address.
        ("core", "hostname_callable"): "infra.netns.host_address",
        ("database", "sql_alchemy_conn"): settings.postgres_uri(pg, settings.airflow_db),
        ("api", "host"): settings.address("airflow"),
        ("api", "base_url"): api,
        ("celery", "broker_url"): f"redis://:{creds['redis_password']}@{settings.address('broker')}:"
                                  f"{settings.redis_port}/0",
        ("celery", "result_backend"): "db+" + settings.postgres_uri(pg, settings.airflow_db, scheme="postgresql"),
        ("celery", "worker_concurrency"): str(settings.worker_concurrency),
        # A task whose worker host died stops heartbeating: the scheduler fails it (and so retries
        # it on the other worker) once this many seconds pass. The default, 300 s, left a run
        # waiting 5 minutes per lost worker; heartbeats come every few seconds
        # ([workers] min_heartbeat_interval), so 30 s still spares a task on a loaded machine.
        ("scheduler", "task_instance_heartbeat_timeout"): str(settings.task_heartbeat_timeout_s),
        ("scheduler", "task_instance_heartbeat_timeout_detection_interval"): "5",
    }
    env.update({f"AIRFLOW__{s.upper()}__{k.upper()}": v for (s, k), v in conf.items()})
    env.update(connections_env(s3_endpoint=settings.s3_endpoint, access_key=creds["access_key"],
                               secret_key=creds["secret_key"], mlflow_uri=settings.mlflow_uri))
    env.update({"MXPIPE_ARTIFACT_ROOT": artifact_root(settings.bucket), "MXPIPE_SCHEDULE": "none",
                "MXPIPE_RETRY_DELAY_S": str(settings.retry_delay_s),
                "MXPIPE_HOSTS_FILE": str(shared_config(root) / "hosts.json")})
    return _host_env(root, settings, host, env)


def _airflow_cmd(settings: TopologySettings, host: str, component: str) -> list[str]:
    airflow = str(BIN_DIR / "airflow")
    if component == "api-server":
        return [airflow, "api-server", "--host", settings.address(host), "--port", str(settings.airflow_port)]
    if component == "celery-worker":
        # A Celery node name of its own: the namespaces share one hostname.
        return [airflow, "celery", "worker", "--celery-hostname", f"{host}@{settings.address(host)}",
                "--concurrency", str(settings.worker_concurrency)]
    # The scheduler runs no task (Celery does), so it serves no logs.
    return [airflow, component, *(["--skip-serve-logs"] if component == "scheduler" else [])]


# Seconds before an Airflow server that exited is started again (``_restarting``).
RESTART_DELAY_S = 5


def _restarting(cmd: list[str]) -> list[str]:
    """``cmd`` started again whenever it exits, as ``restart: unless-stopped`` does in
    docker/compose.yaml: Airflow's scheduler, DAG processor and triggerer exit on a lost database
    connection (measured: a PostgreSQL restart, 2.7 s without connections, ended all three, and
    the run stalled until someone started them). ``down`` stops the loop with its server: the
    session's SIGTERM ends the non-interactive shell at once (an untrapped signal)."""
    loop = (f'while :; do "$@"; echo "{cmd[1] if len(cmd) > 1 else cmd[0]} exited with status $?; '
            f'starting it again in {RESTART_DELAY_S} s"; sleep {RESTART_DELAY_S}; done')
    return ["sh", "-c", loop, "restarting", *cmd]


def start_airflow_hosts(root: Path, settings: TopologySettings, creds: Mapping[str, str],
                        echo: Callable[[str], None]) -> list[GroupRecord]:
    envs = {host: airflow_host_env(root, settings, creds, host) for host in AIRFLOW_HOSTS}
    migrate = _launch(root, settings, "airflow", "airflow-db-migrate", [str(BIN_DIR / "airflow"), "db", "migrate"],
                      envs["airflow"])
    try:
        rc = migrate.wait(START_TIMEOUT_S["migrate"])
    except subprocess.TimeoutExpired as exc:
        raise ServiceError(f"airflow db migrate took over {START_TIMEOUT_S['migrate']:.0f}s") from exc
    finally:
        migrate.stop(timeout=10)
    if rc != 0:
        raise ServiceError(f"airflow db migrate failed (rc={rc}):\n{migrate.log_tail()}")
    echo("airflow db migrated (PostgreSQL)")
    since = time.time()
    handles = [_launch(root, settings, host, f"airflow-{comp}", _restarting(_airflow_cmd(settings, host, comp)), envs[host],
                       port=settings.airflow_port if comp == "api-server" else None)
               for host, comps in AIRFLOW_HOSTS.items() for comp in comps]

    def ready() -> bool:
        for h in handles:
            # A server that fails at its start is started again and again: say so (the loop's
            # line, not its command line, which the log's first line quotes).
            if not h.is_running() or re.search(r"exited with status \d+; starting it again", h.log_tail()):
                raise ServiceError(f"{h.name} exited; log tail:\n{h.log_tail()}")
        return _airflow_ready(settings.airflow_url, ("scheduler", "dag-processor", "triggerer"), since)

    wait_until(ready, START_TIMEOUT_S["airflow"], "Airflow health (/api/v2/monitor/health)", interval_s=2.0)
    for host in WORKERS:
        wait_until(lambda host=host: _celery_ready(root, host), START_TIMEOUT_S["worker"],
                   f"Celery worker on {host}", interval_s=2.0)
    return handles


def _celery_ready(root: Path, host: str, since: int = 0) -> bool:
    """Celery prints "<node> ready." once it consumes from the broker (``since``: a log offset,
    the start of this start's lines)."""
    log = host_records(root, host) / "logs" / "airflow-celery-worker.log"
    if not log.exists():
        return False
    with open(log, "rb") as fh:
        fh.seek(since)
        text = fh.read().decode(errors="replace")
    return f"{host}@" in text and " ready." in text


def restart_airflow_server(root: Path, host: str, component: str) -> GroupRecord:
    """Start ``component`` (``celery-worker``, ``triggerer``, …) on ``host`` again, as ``up``
    did, after its processes died (a fault run kills a host's processes): its record replaces the
    dead one, so ``down`` stops the new server. Waits until a Celery worker consumes again."""
    settings = TopologySettings.model_validate_json((root / "topology.json").read_text())
    if component not in AIRFLOW_HOSTS.get(host, ()):
        raise ValueError(f"{host} runs {AIRFLOW_HOSTS.get(host, ())}, not {component!r}")
    log = host_records(root, host) / "logs" / f"airflow-{component}.log"
    offset = log.stat().st_size if log.exists() else 0
    handle = _launch(root, settings, host, f"airflow-{component}", _restarting(_airflow_cmd(settings, host, component)),
                     airflow_host_env(root, settings, secrets(root), host),
                     port=settings.airflow_port if component == "api-server" else None)
    if component == "celery-worker":
        wait_until(lambda: _celery_ready(root, host, offset), START_TIMEOUT_S["worker"], f"Celery worker on {host}",
                   handle=handle, interval_s=1.0)
    return handle


def restart_postgres(root: Path) -> GroupRecord:
    """PostgreSQL stopped (fast shutdown: every client's connection is cut) and started again."""
    settings = TopologySettings.model_validate_json((root / "topology.json").read_text())
    old = load_handle(host_records(root, "db"), "postgres")
    if old is not None and not stop_postgres(root, settings, old):
        raise ServiceError("PostgreSQL did not stop")
    return start_postgres(root, settings, secrets(root))


def start_training_hosts(root: Path, settings: TopologySettings) -> list[GroupRecord]:
    """sshd on each training host, and in ``etc/`` (every host's, read-only) the client key, the
    pinned host keys, each host's sshd files and ``hosts.json`` (the ``hosts`` backend's
    machines, ``MXPIPE_HOSTS_FILE``): provisioning, as a configuration manager lays it out, not
    files written into a home."""
    from infra.transport import HostSpec, run_on

    keys = shared_config(root) / "ssh"
    keys.mkdir(parents=True, exist_ok=True)
    client_key = keys / "id_ed25519"
    if not client_key.exists():
        netns.keygen(client_key, f"{settings.prefix}-workers")
    sshd = shutil.which("sshd", path=netns.SBIN_PATH)
    if not sshd:
        raise ServiceError("sshd not found (Debian: openssh-server)")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
    handles, known = [], []
    for host in TRAINING_HOSTS:
        folder = shared_config(root) / "sshd" / host
        folder.mkdir(parents=True, exist_ok=True)
        host_key = folder / "host_ed25519"
        if not host_key.exists():
            netns.keygen(host_key, settings.namespace(host))
        authorized = folder / "authorized_keys"
        shutil.copy(f"{client_key}.pub", authorized)
        known.append(f"{settings.address(host)} {' '.join(Path(f'{host_key}.pub').read_text().split()[:2])}\n")
        config = folder / "sshd_config"
        # Its pid file in the host's own home: the one thing sshd writes.
        config.write_text(netns.sshd_config(settings.address(host), host_key, authorized, host_home(root, host)))
        handles.append(_launch(root, settings, host, "sshd", [sshd, "-D", "-e", "-f", str(config)],
                               _host_env(root, settings, host, {})))
    (keys / "known_hosts").write_text("".join(known))
    # One hosts list for every host that reaches the training hosts (the workers; the triggerer,
    # whose deferred train task's on_kill stops a job; the supervisor on the first training
    # host), naming the one key in etc/ that each of them sees at the same path.
    hosts = [{"name": host, "address": settings.address(host), "transport": "ssh", "ssh_user": "root",
              "ssh_key": str(client_key), "known_hosts": str(keys / "known_hosts"),
              "python": sys.executable, "workdir": str(REPO_ROOT),
              "state_dir": str(host_home(root, host) / "roles")} for host in TRAINING_HOSTS]
    (shared_config(root) / "hosts.json").write_text(json.dumps(hosts, indent=2))
    for spec, handle in zip([HostSpec.from_dict(h) for h in hosts], handles):
        wait_until(lambda spec=spec: run_on(spec, "true", timeout_s=10), START_TIMEOUT_S["sshd"],
                   f"sshd on {spec.name}", handle=handle, interval_s=0.5)
    return handles


# ---------------------------------------------------------------------------------------------
# up, down, status


def topology_root(root: str | os.PathLike[str] | None = None) -> Path:
    return Path(root).resolve() if root else mxpipe_home() / "topology"


def up(root: Path, settings: TopologySettings, echo: Callable[[str], None] = print) -> None:
    """Bring the whole deployment up; on any failure, bring down what was started."""
    state = root / "topology.json"
    if state.exists():
        raise ServiceError(f"a topology is already up under {root} (python -m infra.topology down first)")
    clash = netns.namespaces(f"{settings.prefix}-")
    if clash or netns.link_exists(settings.uplink):
        raise ServiceError(f"namespaces {clash} or the link {settings.uplink} exist already: another topology "
                           f"with prefix {settings.prefix!r} runs on this machine")
    root.mkdir(parents=True, exist_ok=True)
    state.write_text(settings.model_dump_json(indent=2))
    t0 = time.monotonic()
    # The mount point of each host's view of <root> (host_command) and the shared configuration.
    for folder in (root / ".view", shared_config(root)):
        folder.mkdir(exist_ok=True)
    try:
        netns.add_switch(settings.switch)
        for i, host in enumerate(HOSTS):
            # Empty on a new root: a host's own processes are the only writers of its home.
            host_home(root, host).mkdir(parents=True, exist_ok=True)
            netns.add_host(settings.switch, settings.namespace(host), f"p{i}", settings.address(host))
        netns.add_uplink(settings.switch, settings.uplink, settings.uplink_address)
        echo(f"hosts   {len(HOSTS)} namespaces on {settings.subnet}.0/24 (this machine: {settings.uplink_address})")
        creds = secrets(root)
        for name, start in (("postgres", start_postgres), ("redis", start_redis), ("s3", start_seaweedfs),
                            ("mlflow", start_mlflow)):
            t = time.monotonic()
            start(root, settings, creds)
            echo(f"{name:<7} up in {time.monotonic() - t:.1f}s")
        t = time.monotonic()
        start_training_hosts(root, settings)
        echo(f"sshd    up on {', '.join(TRAINING_HOSTS)} in {time.monotonic() - t:.1f}s")
        t = time.monotonic()
        start_airflow_hosts(root, settings, creds, echo)
        echo(f"airflow up at {settings.airflow_url} in {time.monotonic() - t:.1f}s (CeleryExecutor, "
             f"workers on {', '.join(WORKERS)})")
    except BaseException:
        echo("up failed: bringing down what started")
        down(root, echo)
        raise
    echo(f"topology up in {time.monotonic() - t0:.1f}s; root {root}")


def _records(root: Path) -> list[tuple[str, GroupRecord]]:
    found = []
    for host in HOSTS:
        for pid_file in sorted((host_records(root, host) / "run").glob("*.json")):
            handle = load_handle(host_records(root, host), pid_file.stem)
            if handle is not None:
                found.append((host, handle))
    return found


def down(root: Path, echo: Callable[[str], None] = print) -> bool:
    """Stop every server (Airflow first, the stores last), delete every namespace and the uplink.
    False if anything failed to stop or was still running in a namespace."""
    state = root / "topology.json"
    settings = TopologySettings.model_validate_json(state.read_text()) if state.exists() else TopologySettings()
    records = _records(root)
    if not (state.exists() or records or netns.namespaces(f"{settings.prefix}-") or netns.link_exists(settings.uplink)):
        echo(f"no topology under {root}")
        return True
    # The Airflow and training hosts together (their servers stop in parallel: the triggerer and
    # a Celery worker each take seconds to wind down), then the stores they used, one by one.
    tiers = [("airflow", "triggerer", *WORKERS, *TRAINING_HOSTS), ("mlflow",), ("s3",), ("broker",), ("db",)]
    ok = True
    for tier in tiers:
        handles = [h for host, h in records if host in tier]
        if tier == ("db",):
            stopped = all(stop_postgres(root, settings, h) for h in handles)
        elif tier == ("s3",):
            stopped = all(stop_s3(h) for h in handles)
        else:
            stopped = stop_all(handles)
        ok &= stopped
        if handles:
            echo(f"{'/'.join(tier):<9} {'stopped' if stopped else 'FAILED to stop'}: "
                 f"{', '.join(sorted({h.name for h in handles}))}")
    names = [settings.switch, *[settings.namespace(h) for h in HOSTS]]
    stuck = netns.delete_namespaces([n for n in names if n in netns.namespaces(f"{settings.prefix}-")],
                                    settings.uplink)
    if stuck:
        echo(f"processes were still running in the namespaces (killed): {stuck}")
        ok = False
    left = netns.namespaces(f"{settings.prefix}-")
    if left or netns.link_exists(settings.uplink):
        echo(f"FAILED to delete namespaces {left} / link {settings.uplink}")
        ok = False
    state.unlink(missing_ok=True)
    echo("topology down" if ok else "topology down with errors (see above)")
    return ok


def status(root: Path, echo: Callable[[str], None] = print) -> bool:
    """Each host's namespace and servers; True if everything recorded runs."""
    state = root / "topology.json"
    if not state.exists():
        echo(f"no topology under {root}")
        return False
    settings = TopologySettings.model_validate_json(state.read_text())
    present = set(netns.namespaces(f"{settings.prefix}-"))
    probes = {"mlflow": f"{settings.mlflow_uri}/health", "airflow-api-server": f"{settings.airflow_url}/api/v2/monitor/health"}
    records = _records(root)
    ok = True
    for host in HOSTS:
        ns = settings.namespace(host)
        echo(f"{host:<9} {settings.address(host):<12} namespace {'up' if ns in present else 'MISSING'}")
        ok &= ns in present
        for _, handle in [r for r in records if r[0] == host]:
            running = handle.is_running()
            ok &= running
            health = ""
            if running and handle.name in probes:
                try:
                    health = f" http {http_get(probes[handle.name], timeout_s=3)[0]}"
                except OSError as exc:
                    health = f" unreachable ({exc})"
            echo(f"    {handle.name:<22} {'running' if running else 'DEAD'} pid {handle.pid}{health}  log {handle.log_path}")
    return ok


def client_env(root: Path) -> dict[str, Any]:
    """What a client on this machine uses: the URLs and the S3 key pair of the running topology."""
    settings = TopologySettings.model_validate_json((root / "topology.json").read_text())
    creds = secrets(root)
    return {"airflow_url": settings.airflow_url, "mlflow_uri": settings.mlflow_uri, "s3_endpoint": settings.s3_endpoint,
            "access_key": creds["access_key"], "secret_key": creds["secret_key"], "bucket": settings.bucket}


EXAMPLES = """
python -m infra.topology up            # every host and server (minutes); make topology
python -m infra.topology status
python -m infra.topology down          # stops all of it, deletes the namespaces; make topology-down
python -m infra.topology compose-env > docker/env.example
"""


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser(__doc__.split("\n")[0], EXAMPLES, prog="python -m infra.topology")
    parser.add_argument("--root", help="the topology's folder (default $MXPIPE_HOME/topology)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="bring the deployment up")
    sub.add_parser("down", help="stop everything, delete the namespaces")
    sub.add_parser("status", help="show each host and server")
    sub.add_parser("compose-env", help="print docker/compose.yaml's env file (placeholder secrets)")
    args = parser.parse_args(argv)
    root = topology_root(args.root)
    if args.cmd == "compose-env":
        sys.stdout.write(compose_env(TopologySettings()))
        return 0
    if args.cmd == "up":
        try:
            up(root, TopologySettings())
        except (ServiceError, TimeoutError, subprocess.CalledProcessError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.cmd == "down":
        return 0 if down(root) else 1
    return 0 if status(root) else 1


if __name__ == "__main__":
    sys.exit(main())
