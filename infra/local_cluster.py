"""The embedded default backend: every role is a process on this machine, bound to 127.0.0.1.

``provision`` checks that this host can run the roles (mxnet with the distributed kvstore) and
writes the cluster's record. Each attempt's roles are started in process groups of their own
and recorded under ``<record>/procs/<attempt>/``, so ``teardown`` (from any process, e.g. an
Airflow teardown task after the training task was killed) stops every group still alive. Each
role watches its supervisor by pid and start time and ends itself within seconds of its death
(``common.procs.watchdog``). The
detached supervisor is recorded under ``$MXPIPE_HOME/jobs/<cluster>/procs/`` and logs to
``$MXPIPE_HOME/jobs/<cluster>/<job_id>.log``, outside the cluster's record, so its log outlives
the teardown.

The local backend is one host by nature: its supervisor is a child of the Airflow worker that
started it, and its process records are on that worker's disk. Under an executor that runs tasks
on several hosts (the CeleryExecutor), a release, ``on_kill`` or retry on another worker would
stop nothing: ``refuse_across_hosts`` turns that into a provision error naming the backend and
the executor, unless the deployment says it is one host (``MXPIPE_SINGLE_HOST``).

``spec.options["worker_argv"]``, when given, is the command every worker runs instead of
``python -m training worker JOB_URI``, under the same ps-lite environment: how the kvstore probes
and benchmarks run a worker script of their own as a real job (``training.launch.detached.local_cluster``).
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from common.procs import GroupSpawner, ProcessRole, free_port, kill_groups, kill_recorded
from common.procs.identity import ProcessIdentity
from common.procs.watchdog import supervised_by
from common.roles import TRACKING_SECRETS, WORKER, JobLaunch, role_argv, role_env
from infra.cluster import (STOP_JOB_GRACE_S, Cluster, ClusterSpec, ProvisionError, cluster_id_for,
                           supervise_argv)

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CHECK_TIMEOUT_S = 180
_CHECK_SNIPPET = (
    "from common.mx import import_mxnet; mx = import_mxnet(); "
    "assert mx.runtime.Features().is_enabled('DIST_KVSTORE'), 'mxnet lacks the distributed kvstore'"
)


# Executors that run every task on the host of the scheduler that queued it (Airflow's own names;
# ``[core] executor`` may also give an import path or ``alias:path``, matched on the class name).
ONE_HOST_EXECUTORS = frozenset({"LocalExecutor", "SequentialExecutor", "DebugExecutor"})


def refuse_across_hosts(executor: str, *, single_host: bool) -> None:
    """A ``ProvisionError`` when Airflow's ``[core] executor`` (one name, or several separated
    by commas, any of which a task may use) can run a task on another host than the provision's,
    and ``single_host`` (``MXPIPE_SINGLE_HOST``) does not say the deployment is one host."""
    if single_host:
        return
    names = [part.strip().split(":")[-1].split(".")[-1] for part in executor.split(",") if part.strip()]
    across = [n for n in names if n not in ONE_HOST_EXECUTORS]
    if across:
        raise ProvisionError(
            f"the local backend cannot run under Airflow's {', '.join(across)} (executor setting {executor!r}): "
            "its supervisor would be a child of one worker, and a release, on_kill or retry on another "
            "worker could not stop it. Use the hosts or ec2 backend, or set MXPIPE_SINGLE_HOST=1 if every "
            "worker of this deployment is this one host")


class LocalCluster(Cluster):
    backend = "local"

    def __init__(self, cluster_id: str, spec: ClusterSpec, home: str | None = None,
                 records: str | None = None) -> None:
        super().__init__(cluster_id, spec, home, records)
        self.host = LOOPBACK
        self.python = spec.image or sys.executable

    @classmethod
    def provision(cls, spec: ClusterSpec, home: str | None = None, *, records: str | None = None) -> "LocalCluster":
        """Create (or, on a retry, find) the cluster of ``spec.run_tag``. Idempotent."""
        cluster = cls(cluster_id_for(spec.run_tag), spec, home, records)
        if cluster.exists():
            log.info("cluster %s already provisioned; reusing it", cluster.cluster_id)
            return cluster
        cluster._check_host()
        cluster.write_record()
        log.info("provisioned local cluster %s: %d workers, %d servers on %s",
                 cluster.cluster_id, spec.workers, spec.servers, cluster.host)
        return cluster

    def _check_host(self) -> None:
        started = time.monotonic()
        try:
            proc = subprocess.run([self.python, "-c", _CHECK_SNIPPET], capture_output=True, text=True,
                                  timeout=_CHECK_TIMEOUT_S, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired as exc:
            raise ProvisionError(f"host check did not finish within {_CHECK_TIMEOUT_S}s") from exc
        if proc.returncode != 0:
            raise ProvisionError(f"this host cannot run MXNet roles: {proc.stderr.strip()[-500:]}")
        log.info("host check passed in %.1fs", time.monotonic() - started)

    def extra_description(self) -> dict[str, Any]:
        # Its home, unlike other backends': every process of a local cluster is on this host.
        return {"host": self.host, "home": self.home}

    def scheduler_address(self) -> tuple[str, int]:
        return self.host, free_port(self.host)

    def spawner(self) -> GroupSpawner:
        """A spawner for one attempt's roles, recorded so teardown can find them."""
        return GroupSpawner(os.path.join(self.state_dir, "procs", self.new_attempt()))

    def start_roles(self, launch: JobLaunch) -> list[ProcessRole]:
        host, port = self.scheduler_address()
        spawner = self.spawner()
        # This process is the job's supervisor: the MLflow credentials of its live run are never a role's.
        base = {**{k: v for k, v in os.environ.items() if k not in TRACKING_SECRETS}, "MXPIPE_CLUSTER": self.cluster_id,
                # Every role watches this process by pid and start time and ends itself once it is gone.
                **supervised_by(ProcessIdentity.of())}
        worker_argv = list(self.spec.options.get("worker_argv") or ())
        handles = []
        try:
            for role in launch.roles():
                env = role_env(launch, role.kind, node_host=self.host, root_uri=host, root_port=port,
                               base=base, repo_root=REPO_ROOT)
                argv = worker_argv if role.kind == WORKER and worker_argv else role_argv(role.kind, launch.job_uri,
                                                                                         self.python)
                proc = spawner.spawn(role.name, argv, env, cwd=REPO_ROOT)
                handles.append(ProcessRole(role.name, role.kind, self.host, proc))
        except BaseException:
            spawner.kill_all(grace_s=1.0)
            raise
        return handles

    def stop_roles(self, handles: Sequence[Any], *, grace_s: float = 5.0) -> int:
        return kill_groups((h.proc.pid for h in handles), grace_s=grace_s)

    @property
    def jobs_dir(self) -> str:
        return os.path.join(self.home, "jobs", self.cluster_id)

    def start_supervisor(self, job_uri: str, *, job_id: str, attempt: int, env: dict[str, str]) -> dict[str, Any]:
        """``python -m training supervise`` in a session of its own on this host, output to a log."""
        os.makedirs(self.jobs_dir, exist_ok=True)
        log_path = os.path.join(self.jobs_dir, f"{job_id}.log")
        with open(log_path, "ab") as out:
            proc = GroupSpawner(os.path.join(self.jobs_dir, "procs")).spawn(
                job_id, supervise_argv(self.python, job_uri, job_id, attempt),
                {**env, "MXPIPE_CLUSTER": self.cluster_id}, cwd=REPO_ROOT, stdout=out)
        # No path at INFO: this line reaches the train task's log, whose readers (on other hosts)
        # read the job's log from storage (common.job_log); the file is this host's copy.
        log.info("started supervisor of job %s: pid %d on %s", job_id, proc.pid, self.host)
        log.debug("supervisor of job %s: its output on this host in %s", job_id, log_path)
        return {"job_id": job_id, "host": self.host, "pid": proc.pid, "log": log_path}

    def _stop_roles_recorded(self, grace_s: float, wait_s: float = 0.0) -> list[str]:
        stopped: list[str] = []
        procs = os.path.join(self.state_dir, "procs")
        if os.path.isdir(procs):
            for attempt in sorted(os.listdir(procs)):
                stopped += kill_recorded(os.path.join(procs, attempt), grace_s=grace_s, wait_s=wait_s)
        return stopped

    def stop_job(self, *, grace_s: float = STOP_JOB_GRACE_S) -> list[str]:
        supervisors = os.path.join(self.jobs_dir, "procs")
        stopped = kill_recorded(supervisors, grace_s=grace_s) if os.path.isdir(supervisors) else []
        # Roles a gone supervisor left are ending themselves (rank 0 writing its emergency
        # checkpoint): they get the grace to, before anything is signalled.
        stopped += self._stop_roles_recorded(5.0, wait_s=grace_s)
        if stopped:
            log.info("stopped job of cluster %s: %s", self.cluster_id, stopped)
        return stopped

    def teardown(self) -> dict[str, Any]:
        """Stop the job and every role process still alive, remove the cluster record. Idempotent."""
        stopped = self.stop_job()
        self.remove_record()
        log.info("tore down cluster %s (%d leftover role group(s) stopped)", self.cluster_id, len(stopped))
        return {"stopped": stopped}

