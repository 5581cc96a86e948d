"""The embedded default cluster backend: every role is a process on this machine.

``provision`` records the cluster (its spec, the run it belongs to, an expiry time) under
``$MXPIPE_HOME/clusters/<id>/`` and checks that this host can run the roles (mxnet with the
distributed kvstore). Roles are started per training attempt through ``spawner()``: a
parameter-server job cannot survive a lost role, so each attempt gets a fresh scheduler,
servers and workers, each in its own process group, recorded in the cluster's folder.
``teardown`` stops every recorded group that is still alive (from any process, e.g. an Airflow
teardown task after the training task was killed) and removes the record. ``find_leaked`` lists
clusters past their expiry, for a reaper.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from common.home import mxpipe_home
from common.paths import safe_component
from common.procs import GroupSpawner, kill_recorded

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
_CHECK_TIMEOUT_S = 180
_CHECK_SNIPPET = (
    "from common.mx import import_mxnet; mx = import_mxnet(); "
    "assert mx.runtime.Features().is_enabled('DIST_KVSTORE'), 'mxnet lacks the distributed kvstore'"
)


class ProvisionError(RuntimeError):
    """The cluster could not be provisioned."""


@dataclass(frozen=True)
class ClusterSpec:
    workers: int
    servers: int
    run_tag: str
    ttl_s: float = 6 * 3600.0
    backend: str = "local"


class LocalCluster:
    def __init__(self, cluster_id: str, spec: ClusterSpec, home: str | None = None) -> None:
        self.cluster_id = cluster_id
        self.spec = spec
        self.home = home or mxpipe_home()
        self.host = LOOPBACK

    @property
    def state_dir(self) -> str:
        return os.path.join(self.home, "clusters", self.cluster_id)

    @classmethod
    def provision(cls, spec: ClusterSpec, home: str | None = None) -> "LocalCluster":
        """Create (or, on a retry, find) the cluster of ``spec.run_tag``. Idempotent."""
        cluster = cls(safe_component(spec.run_tag), spec, home)
        record = os.path.join(cluster.state_dir, "cluster.json")
        if os.path.exists(record):
            log.info("cluster %s already provisioned; reusing it", cluster.cluster_id)
            return cluster
        cluster._check_host()
        os.makedirs(cluster.state_dir, exist_ok=True)
        now = time.time()
        with open(record, "w") as fh:
            json.dump({"spec": asdict(spec), "created_at": now, "expires_at": now + spec.ttl_s,
                       "host": cluster.host}, fh, indent=2)
        log.info("provisioned local cluster %s: %d workers, %d servers on %s",
                 cluster.cluster_id, spec.workers, spec.servers, cluster.host)
        return cluster

    def _check_host(self) -> None:
        started = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-c", _CHECK_SNIPPET], capture_output=True, text=True,
                                  timeout=_CHECK_TIMEOUT_S, cwd=os.path.dirname(os.path.dirname(__file__)))
        except subprocess.TimeoutExpired as exc:
            raise ProvisionError(f"host check did not finish within {_CHECK_TIMEOUT_S}s") from exc
        if proc.returncode != 0:
            raise ProvisionError(f"this host cannot run MXNet roles: {proc.stderr.strip()[-500:]}")
        log.info("host check passed in %.1fs", time.monotonic() - started)

    def describe(self) -> dict:
        """A small JSON-able handle (what Airflow passes between tasks)."""
        return {"backend": "local", "cluster_id": self.cluster_id, "host": self.host, "home": self.home,
                "spec": asdict(self.spec)}

    @classmethod
    def from_description(cls, desc: dict) -> "LocalCluster":
        return cls(desc["cluster_id"], ClusterSpec(**desc["spec"]), desc["home"])

    def spawner(self) -> GroupSpawner:
        """A spawner for one attempt's roles, recorded so teardown can find them."""
        attempt = f"attempt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        return GroupSpawner(os.path.join(self.state_dir, "procs", attempt))

    def teardown(self) -> list[str]:
        """Stop every role process still alive and remove the cluster record. Idempotent."""
        stopped: list[str] = []
        procs = os.path.join(self.state_dir, "procs")
        if os.path.isdir(procs):
            for attempt in sorted(os.listdir(procs)):
                stopped += kill_recorded(os.path.join(procs, attempt))
        shutil.rmtree(self.state_dir, ignore_errors=True)
        log.info("tore down cluster %s (%d leftover role group(s) stopped)", self.cluster_id, len(stopped))
        return stopped


def find_leaked(home: str | None = None, *, now: float | None = None) -> list[str]:
    """Ids of clusters whose expiry time has passed (their run should have torn them down)."""
    root = os.path.join(home or mxpipe_home(), "clusters")
    now = time.time() if now is None else now
    leaked = []
    if os.path.isdir(root):
        for cid in sorted(os.listdir(root)):
            try:
                with open(os.path.join(root, cid, "cluster.json")) as fh:
                    if json.load(fh)["expires_at"] < now:
                        leaked.append(cid)
            except (OSError, ValueError, KeyError):
                leaked.append(cid)
    return leaked
