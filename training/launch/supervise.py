"""The supervisor as a job of its own: ``python -m training supervise JOB_URI --job-id ID``.

It owns every role of one attempt exactly as ``Supervisor.run`` does (exit and stall detection,
stack dumps, one clear error, nothing left behind) and keeps the job's status record
(``training.launch.status``) at ``JobSpec.status_uri``: ``starting`` → ``running`` → one of
``succeeded`` / ``failed`` (with the error and whether it is deterministic) / ``stopped``.
SIGTERM (or SIGINT) is an orderly stop: rank 0 writes its emergency checkpoint within
``checkpoint.preempt_grace_s``, then every role is stopped, and the record ends ``stopped``.

It is started detached by the cluster (``infra``: a session of its own on this host, on the
first host, or on the rank-0 instance through SSM) and outlives whatever started it, so an
Airflow worker that dies mid-training takes no supervision with it.

Why the cluster is a name in the job document and not an import: the roles run wherever the
cluster puts them, and the clusters live in ``infra``, which ``training`` may not import
(dags → plugins → training / infra → common). The task that writes the job (in ``plugins``,
which may import both) puts ``{"factory": "infra.cluster:attach", "description":
cluster.describe()}`` in it; this module calls that factory by name and only uses the result
through the ``RoleCluster`` protocol. ``training`` depends on no backend; the job document
says which one.

One job per checkpoint prefix: a supervisor refuses to start (``EXIT_REFUSED``, the record
untouched) while the record shows another live job (active state, and its supervisor running:
by pid and start time on this machine, else a heartbeat fresher than ``STALE_AFTER_S``).
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from common import storage
from common.errors import DeterministicError
from common.job_log import LogShipper, log_prefix
from common.events import EXIT_BAD_INPUT, EXIT_PREEMPTED
from common.procs.identity import ProcessIdentity
from training.launch.job import JobSpec
from common.roles import TRACKING_SECRETS
from training.launch.launcher import JobFailed, JobObserver, JobStopped, RoleCluster, Supervisor
from training.launch.status import (FAILED, RUNNING, STARTING, STOPPED, SUCCEEDED, JobStatus, StatusWriter,
                                    read_status)

log = logging.getLogger(__name__)

# Exit codes of ``python -m training supervise``.
EXIT_SUCCEEDED, EXIT_FAILED, EXIT_REFUSED = 0, 1, 4
EXIT_DETERMINISTIC, EXIT_STOPPED = EXIT_BAD_INPUT, EXIT_PREEMPTED


class SuperviseError(DeterministicError, RuntimeError):
    """The job document cannot be supervised (no cluster, an unloadable factory, no status URI)."""


def load_factory(path: str) -> Callable[[dict[str, Any]], Any]:
    """The callable ``"package.module:name"`` names."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise SuperviseError(f"a cluster factory is 'package.module:callable', got {path!r}")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SuperviseError(f"cannot load the cluster factory {path!r}: {exc}") from exc
    if not callable(factory):
        raise SuperviseError(f"the cluster factory {path!r} is not callable")
    return factory


def cluster_of(job: JobSpec) -> RoleCluster:
    """The job's cluster, built by the factory its document names."""
    if not job.cluster.get("factory") or "description" not in job.cluster:
        raise SuperviseError("the job document names no cluster ({'factory': ..., 'description': ...})")
    return load_factory(job.cluster["factory"])(job.cluster["description"])


def supervise(job_uri: str, *, job_id: str, attempt: int = 0, base_env: Mapping[str, str] | None = None,
              install_signals: bool = True,
              observer_for: Callable[[JobSpec, RoleCluster], JobObserver | None] | None = None) -> int:
    """Run the job at ``job_uri`` to its end under one supervisor; the exit code says how it ended.
    ``observer_for(job, cluster)`` may give the supervisor an observer (the live MLflow run).

    Every line this process logs (its own, and each role's under its prefix) is shipped to
    storage beside the status record while the job runs (``common.job_log``), and the rest when it
    ends, however it ends: a reader on any host reads the job's log from there."""
    job = JobSpec.load(job_uri)
    if not job.status_uri:
        raise SuperviseError(f"{job_uri} has no status_uri: a supervised job needs a status record")
    shipper = LogShipper(log_prefix(job.status_uri, job_id))
    root = logging.getLogger()
    root.addHandler(shipper)
    try:
        return _supervise(job, job_uri, job_id=job_id, attempt=attempt, base_env=base_env,
                          install_signals=install_signals, shipper=shipper, observer_for=observer_for)
    except BaseException:
        # The traceback goes to the shipped log too: a reader on another host has no other.
        log.exception("the supervisor of job %s failed", job_id)
        raise
    finally:
        root.removeHandler(shipper)
        shipper.close()


def _supervise(job: JobSpec, job_uri: str, *, job_id: str, attempt: int, base_env: Mapping[str, str] | None,
               install_signals: bool, shipper: LogShipper,
               observer_for: Callable[[JobSpec, RoleCluster], JobObserver | None] | None) -> int:
    previous = read_status(job.status_uri)
    if previous is not None and previous.live() and previous.job_id != job_id:
        log.error("refusing to start job %s: job %s on %s (pid %d) is %s, heartbeat %.0fs ago, on the same "
                  "checkpoint prefix", job_id, previous.job_id, previous.host, previous.pid, previous.state,
                  previous.age_s())
        return EXIT_REFUSED
    me = ProcessIdentity.of()  # how a reader on this machine knows at once that this process is gone
    status = StatusWriter(job.status_uri, JobStatus(
        state=STARTING, job_id=job_id, attempt=attempt, started_at=time.time(), host=socket.gethostname(), pid=me.pid,
        process_table=me.table, pid_started=me.started),
        on_error=lambda exc: log.warning("could not write the status record %s: %s", job.status_uri, exc))
    status.update()

    def finish(state: str, **fields: Any) -> None:
        # The log's lines so far are in storage before the record says the job ended: a reader
        # that stops at the final record (the train task's trigger) has read them all.
        shipper.ship()
        status.finish(state, **fields)

    try:
        cluster = cluster_of(job)
    except Exception as exc:  # the record says why, so the operator does not wait for a heartbeat
        log.error("job %s: cannot build its cluster: %s: %s", job_id, type(exc).__name__, exc)
        finish(FAILED, error=f"{type(exc).__name__}: {exc}"[-4000:],
                      deterministic=isinstance(exc, SuperviseError))
        raise
    environ = os.environ if base_env is None else base_env
    # The tracking credentials are the supervisor's (its live run), never a role's.
    roles_env = {k: v for k, v in environ.items() if k not in TRACKING_SECRETS}
    sup = Supervisor(job.config, cluster=cluster, base_env=roles_env, status=status,
                     observer=observer_for(job, cluster) if observer_for is not None else None)
    if install_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: sup.request_stop())
    log.info("supervising job %s (attempt %d) of %s; status record %s", job_id, attempt, job.run_name,
             job.status_uri)
    status.update(state=RUNNING)
    try:
        sup.run(job_uri)
    except JobStopped as exc:
        finish(STOPPED, error=str(exc))
        return EXIT_STOPPED
    except JobFailed as exc:
        finish(FAILED, error=str(exc)[-4000:], deterministic=exc.deterministic, role=exc.role,
                      role_host=exc.host, exit_code=exc.exit_code)
        return EXIT_DETERMINISTIC if exc.deterministic else EXIT_FAILED
    except Exception as exc:  # a cluster or storage error starting the roles: retryable
        log.exception("job %s failed", job_id)
        finish(FAILED, error=f"{type(exc).__name__}: {exc}"[-4000:], deterministic=False)
        return EXIT_FAILED
    outcome = trial_outcome(job)
    log.info("job %s succeeded%s", job_id, f" ({outcome})" if outcome else "")
    finish(SUCCEEDED, **({"outcome": outcome} if outcome else {}))
    return EXIT_SUCCEEDED


def trial_outcome(job: JobSpec) -> str:
    """A sweep trial's end for its status record, from rank 0's metrics: "pruned" (its pruner
    stopped it) or "completed"; empty for a job that is not a pruned sweep trial, or when the
    metrics cannot be read (the record then says only that it succeeded)."""
    if not job.pruning:
        return ""
    try:
        metrics = json.loads(storage.get_bytes(job.metrics_uri))
    except Exception as exc:  # noqa: BLE001 - the job succeeded; its outcome is only a detail of the record
        log.warning("could not read %s for the trial's outcome: %s", job.metrics_uri, exc)
        return ""
    return "pruned" if metrics.get("pruned") else "completed"
