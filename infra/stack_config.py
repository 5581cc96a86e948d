"""Where one local stack lives: its home folder, ports, credentials and the environments built
from them (for clients and for the service processes).

All state lives under one folder, ``$MXPIPE_HOME`` or ``<repo>/.local``::

    credentials.json   S3 key pair + Airflow secrets, mode 0600, generated once
    stack.json         ports and bucket of this home (written on first ``up``)

Every port is on 127.0.0.1. ``with_free_ports`` picks ports below the ephemeral range
(``common.procs.free_port(stable=True)``), and for SeaweedFS also checks port+10000 (its gRPC
convention).

Trap (measured on this 2-core machine): the venv has no ``__pycache__`` and the ambient env sets
``PYTHONDONTWRITEBYTECODE=1``, so every ``import mlflow``/``import airflow`` compiled from source
(2-3x slower). Services get ``PYTHONPYCACHEPREFIX=<repo>/.local/pycache`` instead.
"""
from __future__ import annotations

import json
import os
import secrets
import string
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from common.procs import free_port, port_is_free
from common.settings import settings

REPO_ROOT = Path(__file__).resolve().parents[1]
BIN_DIR = Path(sys.executable).parent
HOST = "127.0.0.1"
REGION = "us-east-1"
WEED_GRPC_OFFSET = 10000  # SeaweedFS convention; the mini admin worker relies on it


class ServiceError(RuntimeError):
    """A service failed to start, died while starting, or its port is taken."""



def mxpipe_home(home: str | os.PathLike[str] | None = None) -> Path:
    return Path(home or settings().local_home).resolve()


def pycache_dir() -> Path:
    return Path(settings().pycache or REPO_ROOT / ".local" / "pycache")


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
    # Where SeaweedFS listens (every part of it: S3, and the filer that serves objects without
    # S3 auth). Loopback unless a test topology needs it on a bridge its hosts reach.
    s3_host: str = HOST
    mlflow_port: int = 5000
    airflow_port: int = 8080
    dags_folder: Path = REPO_ROOT / "dags"
    plugins_folder: Path = REPO_ROOT / "plugins"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.s3_host}:{self.s3_port}"

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
        weed = {k: free_port(HOST, stable=True, offset=WEED_GRPC_OFFSET, taken=taken) for k in
                ("s3_port", "weed_master_port", "weed_volume_port", "weed_filer_port", "weed_admin_port")}
        other = {k: free_port(HOST, stable=True, taken=taken) for k in ("mlflow_port", "airflow_port")}
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
    """The client environment for this stack (a shell, the CLIs): S3, MLflow, artifact root,
    Airflow home, as plain variables."""
    cfg = StackConfig.load(home)
    creds = load_credentials(cfg.home)
    return {
        "AWS_ENDPOINT_URL_S3": cfg.s3_endpoint,
        "AWS_ACCESS_KEY_ID": creds["access_key"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
        "AWS_DEFAULT_REGION": REGION,
        "MLFLOW_TRACKING_URI": cfg.mlflow_uri,
        "MXPIPE_ARTIFACT_ROOT": artifact_root(cfg.bucket),
        "AIRFLOW_HOME": str(cfg.home / "airflow"),
    }


def artifact_root(bucket: str) -> str:
    """The artifact root (``MXPIPE_ARTIFACT_ROOT``) of a stack whose S3 bucket is ``bucket``."""
    return f"s3://{bucket}/runs"


# The stack's S3 connection (Airflow's and the Amazon provider's default id).
AWS_CONN_ID = "aws_default"


def connections_env(*, s3_endpoint: str, access_key: str, secret_key: str, mlflow_uri: str,
                    region: str = REGION) -> dict[str, str]:
    """The Airflow connections ``aws_default`` (S3: key pair, endpoint, region) and
    ``mlflow_default`` (the tracking server) as ``AIRFLOW_CONN_*`` variables in Airflow's JSON
    form, which its environment-variables secrets backend reads first."""
    aws = {"conn_type": "aws", "login": access_key, "password": secret_key,
           "extra": {"endpoint_url": s3_endpoint, "region_name": region}}
    mlflow = {"conn_type": "http", "extra": {"uri": mlflow_uri}}
    return {"AIRFLOW_CONN_AWS_DEFAULT": json.dumps(aws), "AIRFLOW_CONN_MLFLOW_DEFAULT": json.dumps(mlflow)}


def airflow_task_env(home: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """What the Airflow processes of this stack add for the tasks: S3 and MLflow as connections
    (no AWS or MLflow variables: a task applies its connections to its own environment,
    ``plugins.connections``), and the artifact root."""
    cfg = StackConfig.load(home)
    creds = load_credentials(cfg.home)
    return {**connections_env(s3_endpoint=cfg.s3_endpoint, access_key=creds["access_key"],
                              secret_key=creds["secret_key"], mlflow_uri=cfg.mlflow_uri),
            "MXPIPE_ARTIFACT_ROOT": artifact_root(cfg.bucket)}


_DROPPED_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN",
                "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "AIRFLOW_HOME", "PYTHONDONTWRITEBYTECODE")


def service_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The ambient environment without stray credentials, Airflow config and connections, plus
    ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _DROPPED_ENV and not k.startswith(("AIRFLOW__", "AIRFLOW_CONN_"))}
    env.setdefault("PYTHONPYCACHEPREFIX", str(pycache_dir()))
    env.update({"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"})
    env.update(extra)
    return env


def check_ports_free(ports: Iterable[int], service: str) -> None:
    busy = [p for p in ports if not port_is_free(p, HOST)]
    if busy:
        raise ServiceError(f"{service}: port(s) {busy} on {HOST} are in use; pick other ports "
                           "(python -m infra.services up --free-ports) or stop what holds them")

