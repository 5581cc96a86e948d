"""The roles of one ps-lite job, and the environment each role is started with.

Shared by the supervisor (``training.launch.launcher``) and every cluster backend (``infra``): a backend
decides *where* a role runs, this module decides *what* runs there and with which ``DMLC_*`` /
``PS_*`` variables, so the local, hosts and EC2 backends start byte-for-byte the same roles.

ps-lite settings, chosen on purpose (``PsLiteKnobs``):

- ``DMLC_PS_ROOT_URI`` / ``DMLC_PS_ROOT_PORT`` come from the cluster (the scheduler's host and a
  port free there), never from a constant. ``DMLC_NODE_HOST`` is the address of the host a role
  runs on: ps-lite's ZMQ van binds to it (``tcp://<node host>:<port>``), so on the local backend
  nothing listens beyond loopback, and on a multi-host cluster each role advertises the address
  its peers can reach, not whatever the first interface happens to be.
- ``DMLC_INTERFACE`` is only set when a backend names the interface (e.g. ``eth0`` on EC2); with
  ``DMLC_NODE_HOST`` set, ps-lite never consults it, but setting both keeps a mis-typed address
  from silently binding elsewhere.
- ``PS_HEARTBEAT_INTERVAL`` stays 0 (off) by default: a heartbeat never unblocked a
  ``dist_sync`` job after a lost peer here (docs/architecture.md, "A dist_sync job cannot
  survive a lost peer"); the supervisor's exit and stall checks detect failures from outside,
  within seconds.
- ``PS_RESEND`` stays 0 (off) by default: resending cannot bring back a dead role, and on a
  healthy LAN it only adds traffic and duplicate-message handling. A lossy network (cross-AZ,
  not a cluster placement group) is the case for turning it on (``PS_RESEND=1``,
  ``PS_RESEND_TIMEOUT`` in ms).
- ``PS_VERBOSE`` is 0 unless the caller sets it (1 logs connections, 2 every message).
- ``OMP_NUM_THREADS`` / ``MXNET_CPU_WORKER_NTHREADS`` bound each role's threads, so roles that
  share a machine do not oversubscribe its cores.
- ``MXPIPE_FLUSH_DENORMALS`` (``1`` unless ``cluster.flush_denormals`` is false) makes every role
  set FTZ/DAZ on its main thread before importing mxnet (``common.fpmode``: a denormal Adam
  moment made the LeNet benchmark's steps 1.5x slower).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from common.fpmode import ENV as ENV_FLUSH_DENORMALS

SCHEDULER, SERVER, WORKER = "scheduler", "server", "worker"
# Variables a remote role inherits from the launching process (storage credentials, fault
# injection for tests, MXNet/ps-lite tuning); everything else stays on the launching host.
FORWARDED_PREFIXES = ("AWS_", "MXPIPE_", "PS_", "MXNET_", "MLFLOW_")


@dataclass(frozen=True)
class PsLiteKnobs:
    """The ps-lite settings of a job (see the module docstring for why each default)."""

    heartbeat_interval_s: int = 0
    heartbeat_timeout_s: int = 0
    resend: bool = False
    resend_timeout_ms: int = 1000
    interface: str = ""
    verbose: int = 0

    def env(self) -> dict[str, str]:
        out = {"PS_VERBOSE": str(self.verbose), "PS_RESEND": "1" if self.resend else "0",
               "PS_HEARTBEAT_INTERVAL": str(self.heartbeat_interval_s)}
        if self.resend:
            out["PS_RESEND_TIMEOUT"] = str(self.resend_timeout_ms)
        if self.heartbeat_interval_s:
            out["PS_HEARTBEAT_TIMEOUT"] = str(self.heartbeat_timeout_s or 6 * self.heartbeat_interval_s)
        if self.interface:
            out["DMLC_INTERFACE"] = self.interface
        return out


@dataclass(frozen=True)
class Role:
    """One process of the job: ``name`` is unique (``worker-1``), ``rank`` is per kind."""

    name: str
    kind: str
    rank: int


@dataclass(frozen=True)
class JobLaunch:
    """What a cluster needs to start every role of one job attempt."""

    job_uri: str
    num_workers: int
    num_servers: int
    threads_per_role: int = 1
    # Extra variables for every role (on top of the cluster's base environment).
    env: Mapping[str, str] = field(default_factory=dict)
    knobs: PsLiteKnobs = field(default_factory=PsLiteKnobs)
    # False for the single-process kvstores (local, device): the job is its one worker. A
    # scheduler and servers started anyway would wait for workers that never join (measured:
    # the supervisor's 30 s drain, then a kill, after every local job).
    distributed: bool = True
    # Every role flushes denormal floats to zero (common.fpmode; cluster.flush_denormals).
    flush_denormals: bool = True
    # The job's status record: what a role started apart from its supervisor (ec2) watches it by
    # (common.procs.watchdog.supervised_by_record); "" where there is none.
    status_uri: str = ""

    def roles(self) -> list[Role]:
        """Scheduler first, then servers, then workers: the order ps-lite expects them to join."""
        if not self.distributed:
            return [Role(f"{WORKER}-{i}", WORKER, i) for i in range(self.num_workers)]
        return ([Role(SCHEDULER, SCHEDULER, 0)]
                + [Role(f"server-{i}", SERVER, i) for i in range(self.num_servers)]
                + [Role(f"worker-{i}", WORKER, i) for i in range(self.num_workers)])


def role_argv(kind: str, job_uri: str, python: str = sys.executable) -> list[str]:
    if kind == WORKER:
        return [python, "-m", "training", "worker", job_uri]
    # A scheduler or server is mxnet itself: importing it with DMLC_ROLE set runs the role; its
    # floating-point mode must be set before that import (common.fpmode).
    # Its supervisor watch (common.procs.watchdog) and spot watch (common.procs.spot) start
    # first: the import blocks for the role's life. Before them, the open-files limit is raised
    # (common.procs.limits): ps-lite connects every role to every other one.
    return [python, "-c", "from common.procs.limits import raise_open_files_limit; raise_open_files_limit(); "
                          "from common.procs.watchdog import watch_supervisor; watch_supervisor(); "
                          "from common.procs.spot import watch_spot; watch_spot(); "
                          "from common.fpmode import apply_from_env; apply_from_env(); "
                          "from common.mx import import_mxnet; import_mxnet()"]


def role_env(launch: JobLaunch, kind: str, *, node_host: str, root_uri: str, root_port: int,
             base: Mapping[str, str], repo_root: str) -> dict[str, str]:
    """The full environment of one role: ``base`` + the job's extras + ps-lite variables."""
    threads = str(launch.threads_per_role)
    env = dict(base)
    env.update(launch.env)
    env.update(launch.knobs.env())
    if "PS_VERBOSE" in base:  # an explicit PS_VERBOSE of the caller wins (debugging a job)
        env["PS_VERBOSE"] = base["PS_VERBOSE"]
    env.update({
        "OMP_NUM_THREADS": threads,
        "MXNET_CPU_WORKER_NTHREADS": threads,
        "PYTHONUNBUFFERED": "1",
        ENV_FLUSH_DENORMALS: "1" if launch.flush_denormals else "0",
        "PYTHONPATH": os.pathsep.join(p for p in (repo_root, base.get("PYTHONPATH", "")) if p),
    })
    if not launch.distributed:
        # No ps-lite: a worker with DMLC_* inherited would still look like a member of a job.
        return {k: v for k, v in env.items() if not k.startswith("DMLC_")}
    env.update({
        "DMLC_ROLE": kind,
        "DMLC_PS_ROOT_URI": root_uri,
        "DMLC_PS_ROOT_PORT": str(root_port),
        "DMLC_NUM_SERVER": str(launch.num_servers),
        "DMLC_NUM_WORKER": str(launch.num_workers),
        "DMLC_NODE_HOST": node_host,
    })
    return env


# MLflow's credentials: the supervisor's live run uses them; a role never gets them.
TRACKING_SECRETS = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of the launching process's environment a role on another host should get."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
