"""The local service stack: SeaweedFS (S3), an MLflow tracking server and Airflow 3.

``python -m infra.services up|down|status|env`` manages the demo stack; the test fixtures use the
same functions on free ports in a temp folder. All state lives under one folder, ``$MXPIPE_HOME``
or ``<repo>/.local``::

    credentials.json   S3 key pair + Airflow secrets, mode 0600, generated once
    stack.json         ports and bucket of this home (written on first ``up``)
    run/<name>.json    one pid file per service: pid, process group, /proc start time, port, log
    logs/<name>.log    stdout+stderr of each service
    s3/                SeaweedFS data        mlflow/mlflow.db    MLflow backend store
    airflow/           AIRFLOW_HOME (SQLite metadata DB, task logs)

Every service is started in a session (and process group) of its own and stopped by signalling
the whole session, SIGTERM then SIGKILL after a bound: MLflow and Airflow fork helpers, and Airflow
task processes move to process groups of their own but stay in the session. Before ``down``
signals anything it checks that the pid still is the process it launched (the start time in
``/proc/<pid>/stat`` recorded at launch).

Choices and traps (measured on this 2-core machine):

* ``weed mini`` also opens master, volume, filer and admin ports, each with a gRPC port at +10000.
  All are passed explicitly: ``weed mini`` persists its flags in ``<dir>/mini.options`` and
  reloads them on the next start, and its embedded maintenance worker dials the admin at
  ``admin.port + 10000`` whatever ``-admin.port.grpc`` says. Telemetry (on by default, to a
  public URL), WebDAV, Iceberg and Lance are switched off. The filer HTTP port serves objects
  without S3 auth; it is bound to 127.0.0.1 only.
* MLflow runs ``--workers 1`` (uvicorn in-process) and ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``,
  which stops it from spawning huey consumers (GenAI job runner; not used here).
* Airflow: the four components run as separate processes (``api-server``, ``scheduler``,
  ``dag-processor``, ``triggerer``), not ``airflow standalone``: standalone runs the same four
  as threads-with-subprocesses of one parent, gives no per-component logs or pid files, binds
  the API to 0.0.0.0 and starts the log servers (ports 8793/8794 on all interfaces, which collide
  between two stacks). Here the scheduler and triggerer run with ``--skip-serve-logs`` (the
  LocalExecutor writes task logs to local disk, which the API server reads directly).
* The venv has no ``__pycache__`` and the ambient env sets ``PYTHONDONTWRITEBYTECODE=1``, so
  every ``import mlflow``/``import airflow`` compiled from source (2-3x slower). Services get
  ``PYTHONPYCACHEPREFIX=<repo>/.local/pycache`` instead.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent
HOST = "127.0.0.1"
REGION = "us-east-1"
WEED_GRPC_OFFSET = 10000  # SeaweedFS convention; the mini admin worker relies on it
AIRFLOW_COMPONENTS = ("dag-processor", "scheduler", "triggerer", "api-server")
SERVICES = ("s3", "mlflow", "airflow")


class ServiceError(RuntimeError):
    """A service failed to start, died while starting, or its port is taken."""


# ---------------------------------------------------------------------------------------------
# home, stack settings, credentials


def mxpipe_home(home: str | os.PathLike[str] | None = None) -> Path:
    return Path(home or os.environ.get("MXPIPE_HOME") or REPO_ROOT / ".local").resolve()


def pycache_dir() -> Path:
    return Path(os.environ.get("MXPIPE_PYCACHE") or REPO_ROOT / ".local" / "pycache")


@dataclass(frozen=True)
class StackConfig:
    """Where one stack lives and which 127.0.0.1 ports it uses (gRPC ports are +10000)."""

    home: Path
    bucket: str = "mxpipe"
    s3_port: int = 8333
    weed_master_port: int = 9333
    weed_volume_port: int = 9340
    weed_filer_port: int = 8888
    weed_admin_port: int = 23646
    mlflow_port: int = 5000
    airflow_port: int = 8080
    dags_folder: Path = REPO_ROOT / "dags"
    plugins_folder: Path = REPO_ROOT / "plugins"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{HOST}:{self.s3_port}"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{HOST}:{self.mlflow_port}"

    @property
    def airflow_url(self) -> str:
        return f"http://{HOST}:{self.airflow_port}"

    @property
    def weed_ports(self) -> list[int]:
        http = [self.weed_master_port, self.weed_volume_port, self.weed_filer_port, self.s3_port,
                self.weed_admin_port]
        return http + [p + WEED_GRPC_OFFSET for p in http]

    @classmethod
    def with_free_ports(cls, home: str | os.PathLike[str], **overrides: Any) -> "StackConfig":
        """A config whose ports are all free right now (for tests and a second stack)."""
        taken: set[int] = set()
        weed = {k: free_port(taken, grpc=True) for k in
                ("s3_port", "weed_master_port", "weed_volume_port", "weed_filer_port", "weed_admin_port")}
        other = {k: free_port(taken) for k in ("mlflow_port", "airflow_port")}
        return cls(home=Path(home).resolve(), **{**weed, **other, **overrides})

    def save(self) -> None:
        data = {f.name: str(getattr(self, f.name)) if isinstance(getattr(self, f.name), Path)
                else getattr(self, f.name) for f in fields(self) if f.name != "home"}
        _write_private(self.home / "stack.json", json.dumps(data, indent=2))

    @classmethod
    def load(cls, home: str | os.PathLike[str] | None = None) -> "StackConfig":
        """The saved config of ``home``, or the defaults if none was saved yet."""
        root = mxpipe_home(home)
        path = root / "stack.json"
        if not path.exists():
            return cls(home=root)
        data = json.loads(path.read_text())
        for key in ("dags_folder", "plugins_folder"):
            if key in data:
                data[key] = Path(data[key])
        return cls(home=root, **data)


def free_port(taken: set[int] | None = None, *, grpc: bool = False) -> int:
    """A free 127.0.0.1 port below the ephemeral range (with ``grpc``: port+10000 free as well)."""
    import random

    taken = taken if taken is not None else set()
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(10000, 22000)
        wanted = [port, port + WEED_GRPC_OFFSET] if grpc else [port]
        if not taken.intersection(wanted) and all(port_is_free(p) for p in wanted):
            taken.update(wanted)
            return port
    raise ServiceError("no free port found on 127.0.0.1")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like the servers do: a port in TIME_WAIT after a restart is free, a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _write_private(path: Path, text: str) -> None:
    """Write a file readable by the owner only, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def load_credentials(home: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The S3 key pair and Airflow secrets of ``home``, generated on first use (mode 0600)."""
    path = mxpipe_home(home) / "credentials.json"
    if path.exists():
        return json.loads(path.read_text())
    import base64

    alphabet = string.ascii_uppercase + string.digits
    creds = {
        "access_key": "MX" + "".join(secrets.choice(alphabet) for _ in range(18)),
        "secret_key": secrets.token_urlsafe(30),
        "airflow_jwt_secret": secrets.token_urlsafe(64),
        "airflow_api_secret_key": secrets.token_urlsafe(64),
        "airflow_fernet_key": base64.urlsafe_b64encode(os.urandom(32)).decode(),
    }
    _write_private(path, json.dumps(creds, indent=2))
    return creds


def stack_env(home: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The client environment for this stack: S3, MLflow, artifact root, Airflow home."""
    cfg = StackConfig.load(home)
    creds = load_credentials(cfg.home)
    return {
        "AWS_ENDPOINT_URL_S3": cfg.s3_endpoint,
        "AWS_ACCESS_KEY_ID": creds["access_key"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
        "AWS_DEFAULT_REGION": REGION,
        "MLFLOW_TRACKING_URI": cfg.mlflow_uri,
        "MXPIPE_ARTIFACT_ROOT": f"s3://{cfg.bucket}/runs",
        "AIRFLOW_HOME": str(cfg.home / "airflow"),
    }


_DROPPED_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_TRACKING_URI", "AIRFLOW_HOME",
                "PYTHONDONTWRITEBYTECODE")


def service_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The ambient environment without stray credentials/Airflow config, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _DROPPED_ENV and not k.startswith("AIRFLOW__")}
    env.setdefault("PYTHONPYCACHEPREFIX", str(pycache_dir()))
    env.update({"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"})
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------
# processes


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    start_time: int


def _read_proc(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            data = fh.read()
    except OSError:
        return None
    rest = data.rsplit(")", 1)[1].split()  # the command name may contain spaces and parens
    return _Proc(pid, int(rest[1]), int(rest[2]), int(rest[3]), rest[0], int(rest[19]))


def _all_procs() -> list[_Proc]:
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := _read_proc(int(entry))) is not None:
            procs.append(proc)
    return procs


def group_processes(pgid: int, *, include_zombies: bool = False) -> list[int]:
    """Live pids in process group / session ``pgid`` and all their descendants."""
    procs = _all_procs()
    members = {p.pid for p in procs if pgid in (p.pgid, p.sid)}
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    stack = list(members)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in members:
                members.add(child)
                stack.append(child)
    states = {p.pid: p.state for p in procs}
    return sorted(p for p in members if include_zombies or states.get(p) != "Z")


@dataclass
class ServiceHandle:
    """One launched service: the leader of its own session/process group."""

    name: str
    pid: int
    pgid: int
    start_time: int  # /proc/<pid>/stat field 22, to tell our process from a reused pid
    log_path: str
    port: int | None = None
    cmd: list[str] = field(default_factory=list)
    started_at: float = 0.0
    pid_file: str | None = None
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def is_running(self) -> bool:
        proc = _read_proc(self.pid)
        return proc is not None and proc.start_time == self.start_time and proc.state != "Z"

    def owns_group(self) -> bool:
        """False if the pid now belongs to another process (then its group is not ours)."""
        proc = _read_proc(self.pid)
        return proc is None or proc.start_time == self.start_time

    def processes(self) -> list[int]:
        return group_processes(self.pgid) if self.owns_group() else []

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM the whole group, SIGKILL what is left after ``timeout``; True if all gone."""
        if not self.owns_group():
            log.warning("%s: pid %s was reused by another process; not signalling", self.name, self.pid)
            self._remove_pid_file()
            return True
        for sig, bound in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            pids = self.processes()
            if not pids:
                break
            log.info("%s: sending %s to %d process(es)", self.name, sig.name, len(pids))
            _signal_all(self.pgid, pids, sig)
            self._wait_gone(bound)
        self._reap()
        left = self.processes()
        if left:
            log.error("%s: processes %s survived SIGKILL", self.name, left)
            return False
        self._remove_pid_file()
        return True

    def _wait_gone(self, bound: float) -> None:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            self._reap()
            if not self.processes():
                return
            time.sleep(0.1)

    def _reap(self) -> None:
        if self._popen is not None:
            self._popen.poll()

    def _remove_pid_file(self) -> None:
        if self.pid_file:
            Path(self.pid_file).unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 16384))
                text = fh.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ServiceHandle":
        return cls(**json.loads(text))


def _signal_all(pgid: int, pids: Iterable[int], sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:  # task processes in their own groups, helpers in new sessions
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def launch(name: str, cmd: list[str], env: Mapping[str, str], home: Path, *,
           port: int | None = None, cwd: str | os.PathLike[str] | None = None) -> ServiceHandle:
    """Start ``cmd`` in a new session, output to ``<home>/logs/<name>.log``, pid file in run/."""
    logs, run = home / "logs", home / "run"
    logs.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    with open(log_path, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(cmd)}\n".encode())
        out.flush()
        popen = subprocess.Popen(cmd, env=dict(env), cwd=cwd or home, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc = _read_proc(popen.pid)
    handle = ServiceHandle(name=name, pid=popen.pid, pgid=popen.pid,
                           start_time=proc.start_time if proc else 0, log_path=str(log_path),
                           port=port, cmd=list(cmd), started_at=time.time(),
                           pid_file=str(run / f"{name}.json"), _popen=popen)
    Path(handle.pid_file).write_text(handle.to_json())  # type: ignore[arg-type]
    log.info("%s: started pid %s (log %s)", name, popen.pid, log_path)
    return handle


def load_handle(home: Path, name: str) -> ServiceHandle | None:
    path = home / "run" / f"{name}.json"
    if not path.exists():
        return None
    return ServiceHandle.from_json(path.read_text())


def running_handle(home: Path, name: str) -> ServiceHandle | None:
    """The recorded handle if that process still runs; stale records are cleaned up."""
    handle = load_handle(home, name)
    if handle is None:
        return None
    if handle.is_running():
        return handle
    handle.stop(timeout=5)  # leader gone: stop any helper it left behind, drop the pid file
    return None


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, *,
               interval_s: float = 0.5, handle: ServiceHandle | None = None) -> Any:
    """Poll ``predicate`` until it returns a truthy value; bounded, fails early if ``handle`` dies."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        if handle is not None and not handle.is_running():
            handle._reap()
            raise ServiceError(f"{handle.name} exited while waiting for {what}; log tail:\n"
                               f"{handle.log_tail()}")
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
            last = exc
        if time.monotonic() >= deadline:
            tail = f"; log tail:\n{handle.log_tail()}" if handle else ""
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s (last error: {last}){tail}")
        time.sleep(interval_s)


# Health checks go to 127.0.0.1 only: never through an HTTP(S)_PROXY from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with _NO_PROXY_OPENER.open(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_http(url: str, timeout_s: float, *, check: Callable[[bytes], bool] | None = None,
              interval_s: float = 0.5, handle: ServiceHandle | None = None) -> bytes:
    """Poll ``url`` until it answers 200 (and ``check(body)`` holds); returns the body."""

    def ready() -> bytes | None:
        status, body = http_get(url, timeout_s=min(5.0, timeout_s))
        if status != 200:
            raise ServiceError(f"HTTP {status}: {body[:200]!r}")
        return body if check is None or check(body) else None

    return wait_until(ready, timeout_s, url, interval_s=interval_s, handle=handle)


def _check_ports_free(ports: Iterable[int], service: str) -> None:
    busy = [p for p in ports if not port_is_free(p)]
    if busy:
        raise ServiceError(f"{service}: port(s) {busy} on {HOST} are in use; pick other ports "
                           "(python -m infra.services up --free-ports) or stop what holds them")


# ---------------------------------------------------------------------------------------------
# SeaweedFS


def weed_command(cfg: StackConfig) -> list[str]:
    ports = {"master": cfg.weed_master_port, "volume": cfg.weed_volume_port,
             "filer": cfg.weed_filer_port, "s3": cfg.s3_port, "admin": cfg.weed_admin_port}
    cmd = [str(BIN_DIR / "weed"), "mini", f"-dir={cfg.home / 's3'}", f"-ip={HOST}",
           f"-ip.bind={HOST}", "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
           "-s3.port.iceberg=0", "-s3.port.lance=0"]
    for part, port in ports.items():
        cmd += [f"-{part}.port={port}", f"-{part}.port.grpc={port + WEED_GRPC_OFFSET}"]
    return cmd


def s3_client(endpoint: str, access_key: str | None, secret_key: str | None, *,
              unsigned: bool = False) -> Any:
    """A boto3 client with short timeouts and no retries (for health checks and tests)."""
    import boto3
    import botocore
    from botocore.config import Config

    cfg = Config(connect_timeout=3, read_timeout=10, retries={"max_attempts": 1},
                 s3={"addressing_style": "path"},
                 signature_version=botocore.UNSIGNED if unsigned else None)
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, config=cfg,
        aws_access_key_id=access_key, aws_secret_access_key=secret_key)


def ensure_bucket(endpoint: str, access_key: str, secret_key: str, bucket: str) -> None:
    from botocore.exceptions import ClientError

    client = s3_client(endpoint, access_key, secret_key)
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
        client.create_bucket(Bucket=bucket, ACL="private")
        log.info("created bucket %s", bucket)


def _check_auth_enforced(endpoint: str) -> None:
    """SeaweedFS enforces keys only when it was given some; make sure it did."""
    from botocore.exceptions import ClientError

    try:
        s3_client(endpoint, None, None, unsigned=True).list_buckets()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "AccessDenied":
            return
        raise
    raise ServiceError(f"S3 at {endpoint} answers unsigned requests: credentials not enforced")


def start_s3(cfg: StackConfig, *, timeout_s: float = 60.0) -> ServiceHandle:
    """Start ``weed mini`` with the home's credentials enforced; create the bucket."""
    creds = load_credentials(cfg.home)
    _check_ports_free(cfg.weed_ports, "s3")
    (cfg.home / "s3").mkdir(parents=True, exist_ok=True)
    env = service_env({"AWS_ACCESS_KEY_ID": creds["access_key"],
                       "AWS_SECRET_ACCESS_KEY": creds["secret_key"]})
    handle = launch("s3", weed_command(cfg), env, cfg.home, port=cfg.s3_port)
    try:
        client = s3_client(cfg.s3_endpoint, creds["access_key"], creds["secret_key"])
        wait_until(lambda: client.list_buckets() is not None, timeout_s, "S3 list_buckets",
                   handle=handle)
        _check_auth_enforced(cfg.s3_endpoint)
        ensure_bucket(cfg.s3_endpoint, creds["access_key"], creds["secret_key"], cfg.bucket)
    except BaseException:
        stop_s3(handle)
        raise
    return handle


def stop_s3(handle: ServiceHandle, timeout: float = 20.0) -> bool:
    ok = handle.stop(timeout)
    if ok and handle.port:  # weed leaves unix sockets named after its ports in /tmp
        cfg_ports = [int(a.split("=")[1]) for a in handle.cmd if ".port" in a and "=" in a]
        for port in cfg_ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
    return ok


# ---------------------------------------------------------------------------------------------
# MLflow


def start_mlflow(cfg: StackConfig, *, timeout_s: float = 180.0, workers: int = 1) -> ServiceHandle:
    """``mlflow server`` with a SQLite backend and artifacts proxied to S3."""
    creds = load_credentials(cfg.home)
    _check_ports_free([cfg.mlflow_port], "mlflow")
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
# Airflow


def airflow_env(home: str | os.PathLike[str], *, api_port: int = 8080,
                dags_folder: str | os.PathLike[str] | None = None,
                plugins_folder: str | os.PathLike[str] | None = None,
                parallelism: int = 4) -> dict[str, str]:
    """Everything Airflow needs, as ``AIRFLOW_HOME`` + ``AIRFLOW__SECTION__KEY`` variables."""
    root = mxpipe_home(home)
    af_home = root / "airflow"
    creds = load_credentials(root)
    base_url = f"http://{HOST}:{api_port}"
    pythonpath = [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
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
    }
    env = {f"AIRFLOW__{s.upper()}__{k.upper()}": v for (s, k), v in conf.items()}
    env.update({"AIRFLOW_HOME": str(af_home), "PYTHONPATH": os.pathsep.join(pythonpath)})
    return env


def _airflow_process_env(cfg: StackConfig, client_env: Mapping[str, str] | None) -> dict[str, str]:
    extra = dict(stack_env(cfg.home) if client_env is None else client_env)
    extra.update(airflow_env(cfg.home, api_port=cfg.airflow_port, dags_folder=cfg.dags_folder,
                             plugins_folder=cfg.plugins_folder))
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
        rc = handle._popen.wait(timeout=timeout_s)  # type: ignore[union-attr]
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
                  timeout_s: float = 300.0) -> list[ServiceHandle]:
    """Migrate the DB once, start each component in its own session, wait until healthy.

    ``client_env`` (S3/MLflow env for the tasks) defaults to :func:`stack_env` of ``cfg.home``.
    Components already running for this home are reused.
    """
    components = list(components)
    env = _airflow_process_env(cfg, client_env)
    airflow_migrate(cfg, env)
    since = 0.0  # heartbeats must be newer than the first launch (the DB keeps old jobs)
    handles: list[ServiceHandle] = []
    try:
        for comp in components:
            name = f"airflow-{comp}"
            handle = running_handle(cfg.home, name)
            if handle is None:
                since = since or time.time()
                if comp == "api-server":
                    _check_ports_free([cfg.airflow_port], name)
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


def stop_airflow(handles: Iterable[ServiceHandle], timeout: float = 30.0) -> bool:
    """Stop the components in parallel (the triggerer alone takes ~10 s to wind down)."""
    return stop_all(handles, timeout)


def stop_all(handles: Iterable[ServiceHandle], timeout: float = 30.0) -> bool:
    from concurrent.futures import ThreadPoolExecutor

    handles = list(handles)
    if not handles:
        return True
    with ThreadPoolExecutor(max_workers=len(handles)) as pool:
        return all(pool.map(lambda h: h.stop(timeout), handles))


# ---------------------------------------------------------------------------------------------
# the stack (CLI)


def _handles(home: Path, only: Iterable[str]) -> list[tuple[str, ServiceHandle | None]]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.services", description=__doc__.split("\n")[0])
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
    p_env.add_argument("--airflow", action="store_true", help="also the AIRFLOW__* config")
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
        env.update(airflow_env(home, api_port=cfg.airflow_port, dags_folder=cfg.dags_folder,
                               plugins_folder=cfg.plugins_folder))
    import shlex

    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
