"""One interface over every place a job's roles can run: local processes, hosts, EC2.

    cluster = provision(spec)                # idempotent: a retry finds the run's cluster
    handles = cluster.start_roles(launch)    # one attempt's scheduler, servers and workers
    cluster.stop_roles(handles)              # the supervisor, when the attempt ends
    job = cluster.start_supervisor(job_uri, job_id=..., attempt=..., env=...)   # detached
    cluster.stop_job(grace_s=...)            # SIGTERM to the supervisor, then whatever is left
    cluster.release_interrupted(host, replace=...)   # after a spot notice: drop (or replace) its machine
    cluster.teardown()                       # the Airflow teardown task: always
    find_leaked(older_than_s=...)            # the reaper: whatever outlived its TTL

A ``ClusterSpec`` says what is wanted (workers, servers, devices per worker, instance type,
image or environment, TTL) and, in ``options``, where (a host list, an EC2 launch template).
``describe()`` turns a cluster into a small JSON dict, which is what Airflow passes from the
provision task to train and teardown; ``attach`` turns it back into a cluster in any process.

Every backend writes a record of the cluster (its description and expiry time) as one object
``<records>/<id>.json`` (``records_root``: ``s3://<bucket>/clusters/`` beside the artifact root
of a deployment), so a release, a retry or the reaper on any Airflow worker finds an escaped
cluster of any backend, not only the worker that provisioned it; EC2 instances carry the run id
and expiry as tags as well, so the reaper finds them even if this record is lost. What a backend
keeps on the local disk (``state_dir``: the process records of the roles it started itself) is
only ever read by a process of the same host, and losing it loses nothing another host needs. The
scheduler's address comes from the cluster (``scheduler_address``), chosen for each attempt.

The supervisor (``python -m training supervise``) runs detached where the cluster says: on the
local backend as a session of its own on this host, on ``hosts`` on the first host, on ``ec2``
on the rank-0 instance through SSM. It is started through ``python -m common.procs exec-role``
(it leads a recorded process group, output to a log file) under a ``jobs`` folder kept apart
from the roles' records, so the supervisor's own ``stop_roles`` never signals it. The start
returns once that record exists (``local`` writes it before the start returns; ``hosts`` and
``ec2`` run ``detached_supervisor_command``, which waits for it, bounded), since ``stop_job``
finds the supervisor by it alone. ``stop_job`` sends it SIGTERM (``kill-records`` with a grace
long enough for rank 0's emergency checkpoint), then stops any role it left. ``job_cluster()``
is what a job document carries so the supervisor can attach to this cluster
(``training.launch.supervise``).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import math
import posixpath
import shlex
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from common import storage
from common.cli import parser as cli_parser
from common.config import BACKENDS
from common.paths import safe_component
from common.roles import JobLaunch
from common.settings import settings

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 6 * 3600.0
UNREADABLE_GRACE_S = 600.0
# How a job document names the cluster its supervisor attaches to (training.launch.supervise).
CLUSTER_FACTORY = "infra.cluster:attach"
# stop_job's default grace: the default checkpoint.preempt_grace_s (30 s) for rank 0's emergency
# checkpoint, the supervisor's own stop of the other roles, and a margin. Waiting ends as soon
# as the supervisor has exited, so a generous bound costs nothing.
STOP_JOB_GRACE_S = 90.0
# How long a detached supervisor's start waits for it to record itself on its machine (an
# interpreter's start and a file write: seconds even on a loaded machine or a fresh instance).
SUPERVISOR_RECORD_TIMEOUT_S = 30.0
_RECORD_POLL_S = 0.2


def supervise_argv(python: str, job_uri: str, job_id: str, attempt: int) -> list[str]:
    """The supervisor's command line (``python -m training supervise``)."""
    return [python, "-m", "training", "supervise", job_uri, "--job-id", job_id, "--attempt", str(attempt)]


def detached_supervisor_command(workdir: str, argv: Sequence[str], record: str, log_path: str, *,
                                timeout_s: float = SUPERVISOR_RECORD_TIMEOUT_S) -> str:
    """The POSIX shell line, run on the supervisor's machine, that starts ``argv`` (``python -m
    common.procs exec-role --record RECORD … -- python -m training supervise …``) detached from
    ``workdir`` (``setsid nohup``, its output in ``log_path``), then ends once it has written
    ``record``: status 0; after ``timeout_s`` without it, status 1 with the log's last lines on
    standard error. The ``hosts`` backend runs it over its transport, ``ec2`` through SSM.

    Why wait: ``stop_job`` (``on_kill`` right after the start, a release on another worker)
    finds the supervisor by that record only, and a start that returned before it was written
    let such a stop stop nothing and leave the supervisor running. The shell's own loop keeps
    it one remote call."""
    polls = max(1, math.ceil(timeout_s / _RECORD_POLL_S))
    rec, out = shlex.quote(record), shlex.quote(log_path)
    why = shlex.quote(f"the supervisor did not record itself in {record} within {timeout_s:.0f}s; "
                      f"the end of its log {log_path}:")
    return (f"cd {shlex.quote(workdir)} && "
            f"(setsid nohup {shlex.join(argv)} > {out} 2>&1 < /dev/null &) && "
            f"i=0; while [ ! -f {rec} ] && [ $i -lt {polls} ]; do sleep {_RECORD_POLL_S}; i=$((i+1)); done; "
            f"test -f {rec} || {{ echo {why} >&2; tail -n 20 {out} >&2; exit 1; }}")


class ProvisionError(RuntimeError):
    """The cluster could not be provisioned (or found) within its bounds."""


class SupervisorHostLost(ProvisionError):
    """The machine a spot notice reclaims runs the job's supervisor (``release_interrupted``):
    no restart in place can outlive it. The job ends (rank 0's emergency checkpoint first) and its
    retry provisions the cluster again, which replaces that machine."""


@dataclass(frozen=True)
class ClusterSpec:
    """What a run asks for. ``run_tag`` identifies the run (``dag_id--run_id``)."""

    run_tag: str
    workers: int
    servers: int
    backend: str = "local"
    devices_per_worker: int = 0
    instance_type: str = ""
    # A container image (EC2 user data pulls it) or the Python interpreter of an environment
    # that holds this project on every host; empty means "this interpreter" on the local backend.
    image: str = ""
    ttl_s: float = DEFAULT_TTL_S
    # Backend settings: {"hosts": [...]} for hosts, {"region", "launch_template", ...} for EC2.
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.workers < 1 or self.servers < 1:
            raise ValueError(f"a cluster needs >= 1 worker and server, got {self.workers}/{self.servers}")
        if self.ttl_s <= 0 or self.devices_per_worker < 0:
            raise ValueError("ttl_s must be > 0 and devices_per_worker >= 0")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ClusterSpec":
        return cls(**raw)


def records_root(home: str | None = None) -> str:
    """Where cluster records live (a folder URI, S3 or local).

    ``MXPIPE_CLUSTER_RECORDS`` when set; else ``clusters/`` beside the artifact root
    (``s3://mxpipe/clusters`` for the default ``s3://mxpipe/runs``): storage every Airflow worker
    reaches, and outside every run's partition, since a cluster outlives the attempt that made
    it. A caller that passes a ``home`` of its own (a test or probe on one machine, with no S3)
    keeps them under ``<home>/clusters``.
    """
    if home:
        return os.path.join(home, "clusters")
    current = settings()
    if current.cluster_records:
        return current.cluster_records
    root = current.artifact_root.rstrip("/")
    if storage.is_s3(root):
        bucket, key = storage.split_s3(root)
        return storage.join(f"s3://{bucket}", posixpath.dirname(key), "clusters")
    root = root[len("file://"):] if root.startswith("file://") else root
    return os.path.join(os.path.dirname(os.path.abspath(root)), "clusters")


class Cluster(ABC):
    """Base of every backend: the shared record, attempts, describe/attach."""

    backend: ClassVar[str] = ""

    def __init__(self, cluster_id: str, spec: ClusterSpec, home: str | None = None,
                 records: str | None = None) -> None:
        self.cluster_id = cluster_id
        self.spec = spec
        # This host's state folder (process records of what this process started); the record
        # itself is under ``records``, which every host reaches.
        self.home = home or settings().local_home
        self.records = records or records_root(home)

    # -- record -----------------------------------------------------------------------------

    @property
    def state_dir(self) -> str:
        """This host's own folder of the cluster: the process records of roles started here."""
        return os.path.join(self.home, "clusters", self.cluster_id)

    @property
    def record_uri(self) -> str:
        return storage.join(self.records, f"{self.cluster_id}.json")

    def exists(self) -> bool:
        return storage.exists(self.record_uri)

    def write_record(self, **extra: Any) -> None:
        """The record, one object written whole (an S3 PUT, or a local file replaced): a
        reader never sees half of it."""
        now = time.time()
        record = {"description": self.describe(), "created_at": now, "expires_at": now + self.spec.ttl_s, **extra}
        storage.put_bytes(self.record_uri, json.dumps(record, indent=2).encode())

    def remove_record(self) -> None:
        storage.delete_uris([self.record_uri])
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def new_attempt(self) -> str:
        """A fresh name for one attempt's roles (ps-lite needs a fresh job after any failure)."""
        return f"attempt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6}"

    def describe(self) -> dict[str, Any]:
        """The JSON-able handle Airflow passes between tasks. No local folder of the provisioning
        host: a process that attaches elsewhere keeps its own (``home``); only ``local``, whose
        every process is on one host, names it (``LocalCluster.extra_description``)."""
        return {"backend": self.backend, "cluster_id": self.cluster_id, "records": self.records,
                "spec": asdict(self.spec), **self.extra_description()}

    def extra_description(self) -> dict[str, Any]:
        return {}

    def for_attempt(self, attempt: int) -> "Cluster":
        """The cluster a job's attempt ``attempt`` (1, 2, ...) runs on. A retry provisions again
        first: idempotent, it reuses what is healthy and replaces what was lost (a reclaimed spot
        instance), where the previous attempt's failure may have come from."""
        return self if attempt <= 1 else type(self).provision(self.spec, self.home, records=self.records)

    # -- the interface ----------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def provision(cls, spec: ClusterSpec, home: str | None = None, *, records: str | None = None) -> "Cluster":
        """Create, or on a retry find and reuse, the cluster of ``spec.run_tag`` (its record
        under ``records``, default ``records_root(home)``)."""

    @classmethod
    def from_description(cls, desc: dict[str, Any]) -> "Cluster":
        return cls(desc["cluster_id"], ClusterSpec.from_dict(desc["spec"]), desc.get("home"), desc.get("records"))

    @abstractmethod
    def scheduler_address(self) -> tuple[str, int]:
        """Host and a free port for this attempt's scheduler."""

    @abstractmethod
    def start_roles(self, launch: JobLaunch) -> list[Any]:
        """Start one attempt's roles; returns handles the supervisor watches."""

    @abstractmethod
    def stop_roles(self, handles: Sequence[Any], *, grace_s: float = 5.0) -> int:
        """Stop an attempt's roles (whole process groups, on every host); returns how many lived."""

    def job_cluster(self) -> dict[str, Any]:
        """What a job document names as its cluster: the factory and this cluster's description."""
        return {"factory": CLUSTER_FACTORY, "description": self.describe()}

    @abstractmethod
    def start_supervisor(self, job_uri: str, *, job_id: str, attempt: int, env: dict[str, str]) -> dict[str, Any]:
        """Start the job's supervisor detached (it outlives the caller); returns where it runs
        (``job_id``, ``host``, ``log``)."""

    @abstractmethod
    def stop_job(self, *, grace_s: float = STOP_JOB_GRACE_S) -> list[str]:
        """SIGTERM to the running supervisor (an orderly stop: rank 0's emergency checkpoint,
        then every role), SIGKILL after ``grace_s``, then any role still alive; roles that are
        ending themselves because their supervisor is gone (``common.procs.watchdog``) get up
        to ``grace_s`` to first. Idempotent; returns the names of the process groups that were
        alive."""

    def spot_notice_folder(self, job_uri: str) -> str:
        """Where this cluster's roles record their spot notices for the job at ``job_uri``
        (``common.procs.spot.notice_folder``), for a supervisor that cannot read their output
        while they run; "" where it reads every notice from the roles' output (the default)."""
        return ""

    def release_interrupted(self, host: str, *, replace: bool) -> bool:
        """Stop using the machine of ``host`` (a role handle's ``host``, or the instance id of a
        ``SpotInterruption`` event), which its cloud is reclaiming: what the supervisor calls after
        a spot notice, once it has stopped every role (rank 0's emergency checkpoint first) and
        before it starts them again. Whether the cluster keeps its shape: True when a new machine
        took its place (``replace``, and one could be had); False when it goes on without it, and
        ``spec`` then holds the smaller shape (one worker fewer; a server fewer where each
        machine held one), which the next ``start_roles``' launch must not exceed. A second call
        for the same machine (every role of it reports the notice) returns the first's answer.
        Raises ``SupervisorHostLost`` for the supervisor's own machine. Nothing to do, and True,
        for a backend with no machines of its own to lose (``local``, ``hosts``)."""
        log.info("%s cluster %s: nothing to release for %s", self.backend, self.cluster_id, host)
        return True

    @abstractmethod
    def teardown(self) -> dict[str, Any]:
        """Release everything (roles of every attempt, machines, the record). Idempotent."""


def cluster_id_for(run_tag: str) -> str:
    return safe_component(run_tag)


# Module and class of each backend, imported on first use: the EC2 backend imports boto3, which a
# local run never needs. The names are common.config.BACKENDS, the one list cluster.backend is
# validated against; checked at import, so a backend added in one place and not the other fails
# every import of this module rather than a run's provision.
_REGISTRY: dict[str, tuple[str, str]] = {
    "local": ("infra.local_cluster", "LocalCluster"),
    "hosts": ("infra.hosts_cluster", "HostsCluster"),
    "ec2": ("infra.ec2_cluster", "Ec2Cluster"),
}
if tuple(_REGISTRY) != BACKENDS:
    raise ImportError(f"infra.cluster backends {tuple(_REGISTRY)} differ from common.config.BACKENDS {BACKENDS}")


def backend_class(name: str) -> type[Cluster]:
    """The ``Cluster`` class of backend ``name``."""
    if name not in _REGISTRY:
        raise ProvisionError(f"unknown cluster backend {name!r}; expected one of {BACKENDS}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def provision(spec: ClusterSpec, home: str | None = None, *, records: str | None = None) -> Cluster:
    return backend_class(spec.backend).provision(spec, home, records=records)


def attach(desc: dict[str, Any]) -> Cluster:
    """The cluster a ``describe()`` dict names (in another process, e.g. the train task)."""
    return backend_class(desc["backend"]).from_description(desc)


@dataclass(frozen=True)
class Leak:
    cluster_id: str
    backend: str
    expires_at: float
    description: dict[str, Any] | None


def find_leaked(older_than_s: float = 0.0, *, home: str | None = None, records: str | None = None,
                now: float | None = None) -> list[Leak]:
    """Clusters recorded under ``records`` (default ``records_root(home)``) whose TTL ran out
    more than ``older_than_s`` ago.

    A record that cannot be read counts as leaked once it is ``UNREADABLE_GRACE_S`` old.
    EC2 instances are also found by their tags, without any record: ``ec2_cluster.find_expired``.
    """
    root = records or records_root(home)
    now = time.time() if now is None else now
    leaked: list[Leak] = []
    for uri, modified in storage.list_objects(root):
        name = uri[len(root.rstrip("/")) + 1:]
        # Only the records themselves: a local root also holds this host's state folders.
        if "/" in name or not name.endswith(".json"):
            continue
        cid = name[: -len(".json")]
        try:
            record = json.loads(storage.get_bytes(uri))
            expires_at = float(record["expires_at"])
            desc = record["description"]
        except FileNotFoundError:
            continue  # torn down since the listing
        except (ValueError, KeyError, TypeError):
            # Written whole, so unreadable means damaged; the grace spares a clock skew.
            if now - modified > UNREADABLE_GRACE_S + older_than_s:
                leaked.append(Leak(cid, "unknown", 0.0, None))
            continue
        if expires_at + older_than_s < now:
            leaked.append(Leak(cid, desc.get("backend", "unknown"), expires_at, desc))
    return leaked


def reap(older_than_s: float = 0.0, *, home: str | None = None, records: str | None = None,
         now: float | None = None) -> list[str]:
    """Tear down every leaked cluster recorded under ``records``; returns their ids."""
    root = records or records_root(home)
    reaped = []
    for leak in find_leaked(older_than_s, records=root, now=now):
        if leak.description is not None:
            try:
                attach(leak.description).teardown()
            except Exception as exc:  # noqa: BLE001 - one broken cluster must not stop the reaper
                log.error("could not tear down leaked cluster %s: %s", leak.cluster_id, exc)
                continue
        else:
            storage.delete_uris([storage.join(root, f"{leak.cluster_id}.json")])
        log.warning("reaped leaked %s cluster %s (expired at %.0f)", leak.backend, leak.cluster_id, leak.expires_at)
        reaped.append(leak.cluster_id)
    return reaped


EXAMPLES = """
python -m infra.cluster leaked                       # one JSON line per cluster past its TTL
python -m infra.cluster reap --older-than-s 600      # tear down those expired 10 minutes ago or more
"""


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.cluster leaked|reap [--older-than-s N]``: the reaper without Airflow."""
    parser = cli_parser("The cluster reaper without Airflow: list (leaked) or tear down (reap) the clusters "
                        "recorded (MXPIPE_CLUSTER_RECORDS, else clusters/ beside MXPIPE_ARTIFACT_ROOT) whose "
                        "time to live ran out.", EXAMPLES,
                        prog="python -m infra.cluster")
    parser.add_argument("cmd", choices=("leaked", "reap"))
    parser.add_argument("--older-than-s", type=float, default=0.0, help="only clusters expired this long ago")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cmd == "leaked":
        for leak in find_leaked(args.older_than_s):
            print(json.dumps({"cluster_id": leak.cluster_id, "backend": leak.backend, "expires_at": leak.expires_at}))
        return 0
    print(json.dumps({"reaped": reap(args.older_than_s)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
