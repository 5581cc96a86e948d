"""Run one job as every run does: its supervisor detached on the job's cluster, waited on.

``run_detached(job_uri, env=..., timeout_s=...)`` is what the Airflow operator does, without
Airflow: it builds the cluster the job document names (``supervise.cluster_of``), starts
``python -m training supervise`` detached on it (``Cluster.start_supervisor``; not while the
record shows another live job on the prefix, and only once the leftovers of a job whose
supervisor died are stopped) and reads the job's status record until it is final. A local supervisor is watched by its pid as well; a
remote one whose heartbeat is stale past ``STALE_AFTER_S`` is stopped as a stall. Then it makes
sure nothing is left (``Cluster.stop_job``; a local supervisor, a child of this process, is
also reaped). It returns the final record of a job that succeeded and raises ``JobFailed``
(the supervisor's one error, role, its host, exit code and whether it is deterministic, from the
record, and where its log is: the job log's storage URI) or ``JobStopped``. When the record
cannot say why (the supervisor exited without a final record, or the job was stopped from here),
the error carries the last lines of the job's log instead.

While it waits, the lines of the job's log (the supervisor's and every role's, shipped to storage
beside the status record: ``common.job_log``; never a file on the supervisor's host) are relayed
into this process's log under the supervisor's own logger (``training.launch.launcher``), as they
appeared when the supervisor ran in this process: a user of ``python -m training run`` sees the
training, a test asserts on its lines. They arrive within the shipper's ``FLUSH_S``. A job past
``timeout_s``, or any exception here (Ctrl-C), stops the job in order first: SIGTERM to the
supervisor, rank 0's emergency checkpoint, then every role.

``python -m training run``, the tests and the benchmarks all start jobs through it: there is one
way a job runs. ``local_cluster`` is the job document's cluster for the local backend
(``infra.cluster:attach`` named, never imported: ``training`` imports no backend).
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from common import storage
from common.job_log import log_prefix, read_new
from common.config import TrainConfig
from common.settings import settings
from training.launch.job import JobSpec
from training.launch.launcher import JobFailed, JobStopped, RoleCluster
from training.launch.status import FAILED, FINAL_STATES, STOPPED, JobStatus, read_status
from training.launch.supervise import SuperviseError, cluster_of, load_factory

log = logging.getLogger(__name__)
# The relayed lines keep the logger they were written under: the supervisor's.
supervisor_log = logging.getLogger("training.launch.launcher")

POLL_S = 0.5
# How long a supervisor that wrote its final record gets to exit before stop_job makes sure.
EXIT_WAIT_S = 30.0
# A stop's bound beyond the emergency checkpoint's grace (the other roles, the last record write).
STOP_MARGIN_S = 30.0
LOG_TAIL_LINES = 40
# The factory a job document names for an ``infra`` cluster (``infra.cluster.CLUSTER_FACTORY``).
INFRA_FACTORY = "infra.cluster:attach"


class JobCluster(RoleCluster, Protocol):
    """The part of a cluster that runs a detached supervisor (``infra.cluster.Cluster``)."""

    def start_supervisor(self, job_uri: str, *, job_id: str, attempt: int, env: dict[str, str]) -> dict[str, Any]: ...

    def stop_job(self, *, grace_s: float = ...) -> list[str]: ...

    def teardown(self) -> dict[str, Any]: ...


def local_cluster(cluster_id: str, cfg: TrainConfig, *, home: str = "",
                  worker_argv: Sequence[str] = (), python: str = "") -> dict[str, Any]:
    """A job document's cluster on the local backend (every role a process of this machine, the
    supervisor a session of its own). ``home``: where its records and the supervisor's log go
    (default ``$MXPIPE_HOME``); ``worker_argv``: a command the workers run instead of
    ``python -m training worker JOB_URI`` (probes and benchmarks); ``python``: the interpreter
    the supervisor and the roles run under (default this one; a test's wrapper of it)."""
    c = cfg.cluster
    spec = {"run_tag": cluster_id, "workers": max(1, c.num_workers), "servers": max(1, c.num_servers),
            "options": {"worker_argv": list(worker_argv)} if worker_argv else {},
            **({"image": python} if python else {})}
    # Never provisioned, so never recorded: its records folder is this host's, not the
    # deployment's (infra.cluster.records_root), so a teardown needs no S3.
    records = os.path.join(home or settings().local_home, "clusters")
    description = {"backend": "local", "cluster_id": cluster_id, "spec": spec, "records": records,
                   **({"home": home} if home else {})}
    return {"factory": INFRA_FACTORY, "description": description}


def run_detached(job_uri: str, *, env: Mapping[str, str], timeout_s: float, job_id: str = "", attempt: int = 0,
                 poll_s: float = POLL_S, replaced_clusters: Sequence[Mapping[str, Any]] = ()) -> JobStatus:
    """Run the job at ``job_uri`` under a detached supervisor started with ``env``; the final
    status record of its success (see the module docstring for everything else). ``timeout_s``
    may be ``math.inf``: the supervisor bounds the job itself (``cluster.job_timeout_s``, stalls).
    ``replaced_clusters``: the clusters (a job document's ``cluster``) of earlier jobs on the same
    status record, whose leftovers a dead supervisor may have left (``python -m training run``
    makes a cluster of its own per command)."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    job = JobSpec.load(job_uri)
    if not job.status_uri:
        raise SuperviseError(f"{job_uri} has no status_uri: a detached job needs a status record")
    current = read_status(job.status_uri)
    if current is not None and current.live():
        # Never a second job on one checkpoint prefix, and never a stop_job of the live one.
        raise JobFailed(f"job {current.job_id} is still live on this run's checkpoint prefix (supervisor pid "
                        f"{current.pid} on {current.host}, heartbeat {current.age_s():.0f}s ago): not starting "
                        "another", role="job", exit_code=None, deterministic=False)
    cluster: JobCluster = cluster_of(job)  # type: ignore[assignment]
    job_id = job_id or f"{attempt}-{uuid.uuid4().hex[:12]}"
    grace_s = float(job.config.checkpoint.preempt_grace_s) + STOP_MARGIN_S
    if current is not None and current.active:
        _stop_leftovers(current, cluster, [_attach(c) for c in replaced_clusters if c], grace_s)
    where = cluster.start_supervisor(job_uri, job_id=job_id, attempt=attempt, env=dict(env))
    pid = int(where.get("pid") or 0)  # the local backend's: a child of this process
    relay = _LogRelay(log_prefix(job.status_uri, job_id))
    try:
        status = _wait(job.status_uri, job_id, pid, timeout_s, poll_s, relay)
    except BaseException as exc:
        log.warning("stopping job %s: %s", job_id, type(exc).__name__)
        cluster.stop_job(grace_s=grace_s)
        _reap(pid)
        relay()
        if isinstance(exc, TimeoutError):
            raise JobFailed(f"job {job_id} {exc}; it was stopped{relay.tail_text()}", role="job", exit_code=None,
                            deterministic=False) from None
        raise
    _wait_exit(pid)
    cluster.stop_job(grace_s=grace_s)  # nothing may outlive the job, whatever the supervisor did
    _reap(pid)
    relay()
    if status is None:
        raise JobFailed(f"the supervisor of job {job_id} exited without a final status record{relay.tail_text()}",
                        role="job", exit_code=None, deterministic=False)
    if status.state == FAILED:
        raise JobFailed(status.error + relay.where(), role=status.role or "job", host=status.role_host,
                        exit_code=status.exit_code, deterministic=status.deterministic)
    if status.state == STOPPED:
        raise JobStopped(status.error or f"job {job_id} was stopped")
    log.info("job %s succeeded at global step %d", job_id, status.global_step)
    return status


def _attach(job_cluster: Mapping[str, Any]) -> JobCluster:
    return load_factory(job_cluster["factory"])(job_cluster["description"])


def _stop_leftovers(gone: JobStatus, cluster: JobCluster, replaced: Sequence[JobCluster], grace_s: float) -> None:
    """The record's job is active but not live (its supervisor died without a final record):
    stop whatever it left before another job starts on the prefix, and tear down the clusters
    this job replaces. Its roles are ending themselves (rank 0 writing its emergency checkpoint,
    which the next job resumes from), and ``stop_job`` gives them ``grace_s`` to before it
    signals anything."""
    log.warning("job %s on this run's checkpoint prefix is %s but %s: stopping what it left first",
                gone.job_id, gone.state, gone.gone_reason())
    for each in (cluster, *replaced):
        if stopped := each.stop_job(grace_s=grace_s):
            log.info("stopped the leftovers of job %s: %s", gone.job_id, stopped)
    for each in replaced:
        each.teardown()


def _wait(status_uri: str, job_id: str, pid: int, timeout_s: float, poll_s: float,
          relay: "_LogRelay") -> JobStatus | None:
    """The job's final record; None if its (local) supervisor exited without one. TimeoutError
    past ``timeout_s`` or on a stale heartbeat."""
    deadline = time.monotonic() + timeout_s
    unreadable = False
    while True:
        relay()
        try:
            # Fail fast: a read riding out an outage inside botocore's retries would hold up the
            # relay of the supervisor's lines for as long; the next poll reads again anyway.
            with storage.fail_fast():
                status = read_status(status_uri)
            unreadable = False
        except Exception as exc:  # noqa: BLE001 - storage trouble: the record is read again next poll
            if not unreadable:  # once per outage, not once per poll
                log.warning("could not read the status record %s: %s", status_uri, exc)
            unreadable = True
            status = None
        ours = status is not None and status.job_id == job_id
        if ours and status.state in FINAL_STATES:
            return status
        # A local supervisor is watched by its pid instead: its heartbeat can age through a
        # storage outage that the job itself rides out.
        if ours and not pid and not status.live():
            raise TimeoutError(f"went silent: its supervisor's heartbeat is {status.age_s():.0f}s old")
        if pid and not _alive(pid):
            status = read_status(status_uri)  # the final write may have landed since the read above
            final = status is not None and status.job_id == job_id and status.state in FINAL_STATES
            return status if final else None
        if time.monotonic() > deadline:
            raise TimeoutError(f"did not end within its bound of {timeout_s:.0f}s")
        time.sleep(poll_s)


def _alive(pid: int) -> bool:
    from common.procs import group_members

    return bool(group_members([pid]))  # the supervisor leads its own group; a zombie is gone


def _wait_exit(pid: int) -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    while pid and _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _reap(pid: int) -> None:
    """Collect a local supervisor's exit status, so it does not linger as a zombie."""
    if not pid:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not a child of this process, or reaped already


class _LogRelay:
    """Relays the new lines of the job's shipped log at each call (``common.job_log``: whole
    chunks, so a line is relayed once), keeping the last ones for an error message."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.seq = 0
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
        self.unreadable = False

    def __call__(self) -> None:
        try:
            with storage.fail_fast():  # as the status read: the next poll reads again
                lines, self.seq = read_new(self.prefix, self.seq)
        except Exception as exc:  # noqa: BLE001 - storage trouble: the same chunks are read next poll
            if not self.unreadable:
                log.warning("could not read the job's log %s: %s", self.prefix, exc)
            self.unreadable = True
            return
        self.unreadable = False
        for line in lines:
            self.tail.append(line)
            supervisor_log.info("%s", line)

    def where(self) -> str:
        return f"\n(the job's log: {self.prefix}/)"

    def tail_text(self) -> str:
        if not self.tail:
            return self.where()
        return f"\nlast lines of the job's log {self.prefix}/:\n" + "\n".join(self.tail)
