"""Launch and supervise every role of one parameter-server job.

ps-lite cannot lose a node: when one role dies, the others block forever (seen here even with
heartbeats set). So the supervisor owns the scheduler, the servers and the workers, and ends the
whole job when any role exits non-zero (seen within one poll, ``POLL_S``), when a worker has
logged nothing for ``cluster.stall_timeout_s`` (``start_timeout_s`` before its first line), or
when the job runs past ``cluster.job_timeout_s`` (0: no limit; the stall bound guards a hung
job). It streams each role's output into this
process's log with a ``[role-rank@host]`` prefix and raises one ``JobFailed`` naming the role,
its host, its exit code or signal and its last lines. Every role is stopped (its whole process
group, on whatever host) before ``run`` returns or raises: after a role failure at once (1 s
SIGTERM grace, the others are blocked in ps-lite), otherwise workers first with the
checkpoint's preemption grace (rank 0 alone first, for its emergency checkpoint; its rank comes
from its worker_started event), then scheduler and servers.

A failed or stalled role costs a restart in place, not the job: every role is stopped and
started again on the same cluster (a fresh ps-lite job, as ps-lite needs after any loss), and
the workers resume from the newest committed checkpoint. ``training.launch.restarts`` bounds
it by progress (``cluster.max_restarts_without_progress``); what a restart cannot fix (a
deterministic failure, the job's timeout, a stop, a spent budget, a cluster that cannot start
the roles) ends the job, and the caller's retry (Airflow's) starts a fresh one.

Where roles run is not this module's business: it takes a cluster (anything with
``start_roles(JobLaunch) -> handles`` and ``stop_roles(handles)``: ``infra.cluster``'s local,
hosts and EC2 backends). It runs inside ``python -m training supervise``, the one way a job runs
(the train task, ``python -m training run``, the tests and the benchmarks all start that command
detached: ``training.launch.detached``). What each role runs and its ps-lite
variables come from ``common.roles`` (its docstring says why each ps-lite knob is set as it is:
``PS_RESEND`` and heartbeats off, ``DMLC_NODE_HOST`` per host, ``DMLC_INTERFACE`` only when a
backend names one).

An optional ``JobObserver`` (``training.tracking.live.LiveRun`` in the train task, handed in by
the caller: this package imports nothing of ``training.tracking``) sees the job as the supervisor
does: ``start`` as it starts, every role line, ``sync`` with the local role pids every poll (it
decides itself when to sample or send), and ``end`` with the outcome (succeeded, failed, stopped:
this process interrupted or terminated) and the error text once every role is stopped;
``restarted`` after each restart in place, with the counts.

With ``MXPIPE_EVENTS_FILE`` set in its base environment, the supervisor appends one JSON line
per event (job start, roles started, each role line with the time it arrived, the failure it
detected, roles stopped, a spot notice acted on, roles restarting in place) to that file: what
``benchmarks/recovery.py`` measures recovery from.
"""
from __future__ import annotations

import collections
import dataclasses
import ipaddress
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.roles import JobLaunch, forwarded_env
from common.settings import settings
from common.config import TrainConfig
from common.events import (EVENT_MARK, CheckpointCommitted, EventError, Resumed, SpotInterruption, WorkerStarted,
                           parse_event)
from common.events import DETERMINISTIC_EXIT_CODES
from training.launch.restarts import RestartBudget
from training.launch.status import StatusWriter

__all__ = ["JobFailed", "JobObserver", "JobStopped", "Supervisor", "launch_for", "outcome_of"]

log = logging.getLogger(__name__)

POLL_S = 0.2
# How often a cluster's recorded spot notices are read (``RoleCluster.spot_notice_folder``): the
# notice comes two minutes ahead, the roles poll their instance every 5 s.
NOTICE_POLL_S = 2.0
TAIL_LINES = 30
# How long the scheduler and servers get to exit on their own once every worker succeeded.
DRAIN_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
# How long a stalled worker's stack dump gets to reach the log before the job is stopped.
STACK_DUMP_WAIT_S = 1.0
# After a role died or stalled the others are blocked inside ps-lite, where a SIGTERM handler
# (the worker's emergency checkpoint) never gets to run: a long grace would only add to the
# recovery time, so they get this much before SIGKILL.
FAILED_STOP_GRACE_S = 1.0


class RoleHandle(Protocol):
    """A started role: ``common.procs.ProcessRole`` or a backend's own (e.g. an SSM command)."""

    name: str
    kind: str
    host: str

    @property
    def stdout(self) -> Iterable[str]: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...


class RoleCluster(Protocol):
    """The part of a cluster the supervisor uses (``infra.cluster.Cluster`` satisfies it)."""

    def start_roles(self, launch: JobLaunch) -> Sequence[RoleHandle]: ...

    def stop_roles(self, handles: Sequence[RoleHandle], *, grace_s: float = 5.0) -> int: ...


class JobObserver(Protocol):
    """What watches a job beside its supervisor (live tracking); it must never raise or block."""

    def start(self) -> None: ...

    def on_line(self, role: str, line: str) -> None: ...

    def sync(self, pids: Mapping[str, int]) -> None: ...

    def end(self, outcome: str, error: str) -> None: ...

    def restarted(self, restarts: int, without_progress: int, reason: str) -> None: ...


def outcome_of(error: BaseException | None) -> tuple[str, str]:
    """``(outcome, error text)`` of a job's end: an exception is a failure; anything else that is
    not an ``Exception`` (KeyboardInterrupt, SystemExit, Airflow's task termination) a stop."""
    if error is None:
        return "succeeded", ""
    if isinstance(error, JobStopped):
        return "stopped", str(error)
    if isinstance(error, Exception):
        return "failed", str(error) or type(error).__name__
    return "stopped", f"stopped: {type(error).__name__} {error}".strip()


def _is_local(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class JobFailed(RuntimeError):
    """The distributed job failed; ``deterministic`` says whether a retry can help."""

    def __init__(self, message: str, *, role: str, exit_code: int | None, deterministic: bool,
                 host: str = "") -> None:
        super().__init__(message)
        self.role = role
        self.host = host
        self.exit_code = exit_code
        self.deterministic = deterministic


class JobStopped(RuntimeError):
    """The job was asked to stop (``Supervisor.request_stop``) and every role has been stopped."""


class _Reclaimed(Exception):
    """A role's machine got a spot interruption notice (the watch loop's signal to ``run``)."""

    def __init__(self, notice: SpotInterruption) -> None:
        super().__init__(f"spot interruption notice for {notice.instance_id} ({notice.host})")
        self.notice = notice


# The role whose log lines carry the job's progress (global step, epoch) into the status record.
PROGRESS_ROLE = "worker-0"


@dataclass
class _Role:
    handle: Any
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    last_output: float = field(default_factory=time.monotonic)
    seen_output: bool = False
    reader: threading.Thread | None = None
    rank: int | None = None  # a worker's kvstore rank, once its worker_started event said it

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def kind(self) -> str:
        return self.handle.kind

    @property
    def host(self) -> str:
        return self.handle.host


def launch_for(cfg: TrainConfig, job_uri: str, env: Mapping[str, str] | None = None,
               status_uri: str = "") -> JobLaunch:
    """The ``JobLaunch`` of a config: its cluster shape and per-role thread bound."""
    c = cfg.cluster
    return JobLaunch(job_uri=job_uri, num_workers=c.num_workers, num_servers=c.num_servers,
                     threads_per_role=c.threads_per_role, env=dict(env or {}), distributed=c.distributed,
                     flush_denormals=c.flush_denormals, status_uri=status_uri)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Events:
    """Optional JSON-lines event log (``MXPIPE_EVENTS_FILE``) for recovery measurements."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        if not self.path:
            return
        line = json.dumps({"t": time.time(), "event": event, **fields})
        with self.lock, open(self.path, "a") as fh:
            fh.write(line + "\n")


class Supervisor:
    """Starts the roles of one job and watches them until success or the first failure."""

    def __init__(self, cfg: TrainConfig, *, cluster: RoleCluster, base_env: Mapping[str, str] | None = None,
                 observer: JobObserver | None = None, status: StatusWriter | None = None) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.roles: list[_Role] = []
        self.events = _Events(settings(self.base_env).events_file)
        self.observer = observer
        self.status = status
        self.budget = RestartBudget(cfg.cluster.max_restarts_without_progress)
        # The newest checkpoint step the roles reported (resumed from, or committed): a round
        # that raised it made progress (``RestartBudget``).
        self.checkpoint_step: int | None = None
        # Spot interruption notices by instance (every role of a machine reports its notice) and
        # the ones not acted on yet.
        self.notices: dict[str, SpotInterruption] = {}
        self.pending_notices: list[SpotInterruption] = []
        # A plain flag, not a threading.Event: setting an Event from a signal handler can deadlock
        # on the lock its waiter holds.
        self.stop_requested = False
        self.job_started = time.monotonic()  # reset by run()
        self.lock = threading.Lock()  # what the line pumps note for the watch loop

    def request_stop(self) -> None:
        """Ask for an orderly stop (safe from a signal handler): ``run`` raises ``JobStopped``."""
        self.stop_requested = True

    # -- starting ---------------------------------------------------------------------------

    def _adopt(self, handle: Any) -> None:
        role = _Role(handle=handle)
        role.reader = threading.Thread(target=self._pump, args=(role,), name=f"pump-{role.name}", daemon=True)
        role.reader.start()
        self.roles.append(role)

    def _pump(self, role: _Role) -> None:
        prefix = f"{role.name}@{role.host}"
        progress = self.status.progress if self.status is not None and role.name == PROGRESS_ROLE else None
        for line in role.handle.stdout:
            line = line.rstrip("\n")
            # The failure message's last lines are for people: an event line (common.events) repeats
            # a human one for the readers and would crowd the human lines out of the record's error.
            if EVENT_MARK not in line:
                role.tail.append(line)
            role.last_output = time.monotonic()
            role.seen_output = True
            log.info("[%s] %s", prefix, line)
            if self.observer is not None:
                self.observer.on_line(role.name, line)
            self.events("line", role=role.name, text=line)
            if progress is not None:
                progress(line)
            if EVENT_MARK in line:
                self._note_event(role, line)

    def _note_event(self, role: _Role, line: str) -> None:
        """What the supervisor itself takes from the roles' events (common.events): a worker's
        kvstore rank (ps-lite's scheduler assigns ranks in the order workers register, so rank 0,
        the checkpoint writer, is not necessarily the role named worker-0), the newest checkpoint,
        and any role's spot interruption notice (the first per instance)."""
        try:
            event = parse_event(line)
        except EventError:  # a malformed event: live tracking reports it
            return
        if isinstance(event, WorkerStarted) and role.rank is None and role.kind == "worker":
            role.rank = event.rank
        elif isinstance(event, (Resumed, CheckpointCommitted)) and role.kind == "worker":
            with self.lock:
                self.checkpoint_step = max(event.step, self.checkpoint_step or 0)
        elif isinstance(event, SpotInterruption):
            self._queue_notice(event)

    def _queue_notice(self, notice: SpotInterruption) -> None:
        """Queue a machine's spot notice for the watch loop, once per instance (from any role's
        output, or recorded under the cluster's notice folder)."""
        with self.lock:
            if notice.instance_id not in self.notices:
                self.notices[notice.instance_id] = notice
                self.pending_notices.append(notice)

    def _watch_notice_folder(self, folder: str, stop: threading.Event) -> None:
        """Read the notices recorded under ``folder`` every ``NOTICE_POLL_S`` until ``stop``, in a
        thread of its own: a read stuck on storage holds up no role line and no failure check."""
        from common import storage
        from common.procs.spot import read_notices

        failing = False
        while not stop.wait(NOTICE_POLL_S):
            try:
                with storage.fail_fast():
                    found = read_notices(folder)
            except Exception as exc:  # noqa: BLE001 - storage trouble: read again at the next poll
                if not failing:
                    log.warning("could not read the spot notices under %s: %s", folder, exc)
                failing = True
                continue
            failing = False
            for notice in found:
                self._queue_notice(notice)

    def run(self, job_uri: str) -> None:
        c = self.cfg.cluster
        self.events("job_start", job_uri=job_uri)
        self.job_started = time.monotonic()
        where = type(self.cluster).__name__
        if c.distributed:
            log.info("starting job: 1 scheduler, %d servers, %d workers on %s", c.num_servers, c.num_workers, where)
        else:
            log.info("starting job: 1 worker, kvstore %s (no scheduler or servers) on %s", c.kvstore, where)
        orderly = True
        error: BaseException | None = None
        if self.observer is not None:
            self.observer.start()
        if self.status is not None:  # its writes wait on storage: never in this loop or a line pump
            self.status.start_beats(POLL_S)
        stop_notices = threading.Event()
        try:
            self._start_notice_watch(job_uri, stop_notices)
            # The cluster supplies each host's base environment; the job adds what a role must
            # inherit from here (storage credentials, fault injection, ps-lite tuning).
            launch = launch_for(self.cfg, job_uri, forwarded_env(self.base_env),
                                status_uri=self.status.uri if self.status is not None else "")
            while True:
                round_start = self.checkpoint_step  # before the roles start: they may commit at once
                self._start_roles(launch)
                try:
                    self._watch()
                    break
                except JobFailed as failure:
                    self._restart_after(failure, progressed=(self.checkpoint_step or 0) > (round_start or 0))
                except _Reclaimed as reclaimed:
                    launch = self._restart_after_notice(reclaimed.notice, launch)
        except BaseException as exc:
            error = exc
            if isinstance(exc, JobFailed):
                orderly = exc.role == "job"  # a job timeout: every role is still alive
            elif isinstance(exc, JobStopped):
                log.warning("stop requested: stopping every role (rank 0 first writes its emergency checkpoint)")
            raise
        finally:
            stop_notices.set()
            self._stop_all(orderly=orderly)
            if self.status is not None:
                self.status.stop_beats()
            if self.observer is not None:
                self.observer.end(*outcome_of(error))

    def _start_notice_watch(self, job_uri: str, stop: threading.Event) -> None:
        """Where the cluster's roles record their spot notices (a cluster whose roles' output
        arrives only once they end: ``ec2``), empty that folder of an earlier job's and read it."""
        folder_of = getattr(self.cluster, "spot_notice_folder", None)  # duck-typed: optional for a cluster
        folder = folder_of(job_uri) if folder_of is not None else ""
        if not folder:
            return
        from common import storage

        storage.delete_prefix(folder)  # one job per prefix: what is there is an earlier job's
        threading.Thread(target=self._watch_notice_folder, args=(folder, stop), name="spot-notices",
                         daemon=True).start()

    def _start_roles(self, launch: JobLaunch) -> None:
        for handle in self.cluster.start_roles(launch):
            self._adopt(handle)
        self.events("roles_started", roles=[r.name for r in self.roles])
        log.info("roles started: %s", " ".join(f"{r.name}@{r.host}" for r in self.roles))

    def _restart_after(self, failure: JobFailed, *, progressed: bool) -> None:
        """Stop every role and let the caller start them again (they resume from the newest
        checkpoint), or re-raise ``failure`` where a restart cannot help: a deterministic
        failure, a job timeout, a stop request, a failure after every worker finished, or the
        budget spent (``RestartBudget``; then as an error of its own, not retried)."""
        finished = all(r.handle.poll() == 0 for r in self.roles if r.kind == "worker")
        if failure.deterministic or failure.role == "job" or self.stop_requested or finished:
            raise failure
        if not self.budget.take(progressed):
            if not self.budget.enabled:
                raise failure
            raise JobFailed(f"{self.budget.exhausted_message(self.checkpoint_step)} {failure}", role=failure.role,
                            exit_code=failure.exit_code, deterministic=True, host=failure.host) from failure
        self._stop_all(orderly=False)
        self.roles = []
        self._announce_restart(str(failure).split("\n", 1)[0])

    def _announce_restart(self, reason: str) -> None:
        """The restart just counted, in the log, the event log, the status record and MLflow."""
        b = self.budget
        log.warning("restarting every role in place from the newest checkpoint (restart %d; %d in a row without "
                    "a new checkpoint, at most %d) after: %s", b.restarts, b.without_progress, b.limit, reason)
        self.events("roles_restarting", restarts=b.restarts, without_progress=b.without_progress, reason=reason)
        if self.status is not None:
            self.status.update(restarts=b.restarts, restarts_without_progress=b.without_progress,
                               last_restart_reason=reason)
        if self.observer is not None:
            self.observer.restarted(b.restarts, b.without_progress, reason)

    def _restart_after_notice(self, notice: SpotInterruption, launch: JobLaunch) -> JobLaunch:
        """A machine of the cluster is being reclaimed (about two minutes from the notice): stop
        every role in order now (rank 0 writes its emergency checkpoint first: no step is lost),
        release the machine (``cluster.on_spot_interruption``: a replacement, or go on without
        it), and return the launch to restart the roles with. A restart that always makes
        progress: counted, never against the budget. Where the cluster shrank and the config
        cannot resume on fewer workers (``checkpoint.elastic``), the job ends as a retryable
        failure: the retry provisions the cluster whole again."""
        log.warning("spot interruption notice for %s (%s, %s at %s): stopping every role now, rank 0 first for "
                    "its emergency checkpoint", notice.instance_id, notice.host, notice.action, notice.time)
        self.events("spot_interruption", instance_id=notice.instance_id, host=notice.host, action=notice.action,
                    time=notice.time)
        self._stop_all(orderly=True)
        self.roles = []
        # Duck-typed: a cluster without machines of its own to lose (a test's) need not offer it.
        release = getattr(self.cluster, "release_interrupted", None)
        replace = self.cfg.cluster.on_spot_interruption == "replace"
        whole = release(notice.host, replace=replace) if release is not None else True
        reason = f"spot interruption notice for {notice.instance_id} ({notice.host})"
        if not whole:
            spec = self.cluster.spec  # type: ignore[attr-defined]  # what release_interrupted left
            if not self.cfg.checkpoint.elastic:
                raise JobFailed(f"{reason}: the cluster goes on with {spec.workers} worker(s), and "
                                f"checkpoint.elastic is off, so the job cannot resume on fewer workers; the "
                                "retry provisions the whole cluster again", role="job", exit_code=None,
                                deterministic=False, host=notice.host)
            launch = dataclasses.replace(launch, num_workers=spec.workers, num_servers=spec.servers)
            reason += f": going on with {spec.workers} worker(s) and {spec.servers} server(s)"
        self.budget.take_with_progress()
        self._announce_restart(reason)
        return launch

    def local_pids(self) -> dict[str, int]:
        """Role name → pid of the roles whose process on this machine is the role itself (the
        local backend); a remote role's local process is only its transport's client."""
        return {r.name: r.handle.proc.pid for r in self.roles
                if _is_local(r.host) and getattr(r.handle, "proc", None) is not None}

    def _stop_all(self, *, orderly: bool) -> None:
        """Stop every role. ``orderly`` (success, job timeout, this process interrupted): the
        workers first, with the config's preemption grace for rank 0's emergency checkpoint
        (they need the servers alive to finish a step), then the rest. After a role failure:
        everything at once with a short grace (see ``FAILED_STOP_GRACE_S``)."""
        started = time.monotonic()
        grace = STOP_GRACE_S if orderly else FAILED_STOP_GRACE_S
        stopped = 0
        if orderly:
            live = [r for r in self.roles if r.kind == "worker" and r.handle.poll() is None]
            preempt = float(getattr(self.cfg.checkpoint, "preempt_grace_s", STOP_GRACE_S))
            # Rank 0 alone first: it finishes its step (its peers still take part), commits the
            # emergency checkpoint and exits. Signalled together, a peer that exits at once
            # leaves rank 0 blocked in that step's push/pull until SIGKILL, with no checkpoint.
            first = [r for r in live if r.rank == 0]
            if first:
                stopped += self.cluster.stop_roles([r.handle for r in first], grace_s=preempt + 1.0)
                live = [r for r in live if r.rank != 0]
            if live:
                stopped += self.cluster.stop_roles([r.handle for r in live],
                                                   grace_s=preempt + 1.0 if not first else grace)
        stopped += self.cluster.stop_roles([r.handle for r in self.roles], grace_s=grace)
        for role in self.roles:
            if role.reader:
                role.reader.join(timeout=5.0)
        self.events("roles_stopped", stopped=stopped, seconds=time.monotonic() - started)
        if stopped:
            log.info("stopped %d role process group(s) in %.1fs", stopped, time.monotonic() - started)

    # -- watching ---------------------------------------------------------------------------

    def _watch(self) -> None:
        c = self.cfg.cluster
        started = self.job_started  # the job's bound counts from its start, across restarts in place
        workers = [r for r in self.roles if r.kind == "worker"]
        while True:
            time.sleep(POLL_S)
            if self.stop_requested:
                raise JobStopped("the job was stopped on request")
            with self.lock:
                notice = self.pending_notices.pop(0) if self.pending_notices else None
            if notice is not None:
                raise _Reclaimed(notice)
            now = time.monotonic()
            if self.observer is not None:
                self.observer.sync(self.local_pids())
            for role in self.roles:
                code = role.handle.poll()
                if code not in (None, 0):
                    self._fail(role, f"{role.name} on {role.host} failed: {_describe_exit(code)}", code)
            if all(w.handle.poll() == 0 for w in workers):
                self._drain()
                log.info("job finished in %.1fs", now - started)
                return
            if c.job_timeout_s and now - started > c.job_timeout_s:
                self._fail(None, f"job exceeded its timeout of {c.job_timeout_s:.0f}s", None)
            for w in workers:
                # Before its first line a worker is still importing mxnet and joining the job.
                limit = c.stall_timeout_s if w.seen_output else c.start_timeout_s
                if w.handle.poll() is None and now - w.last_output > limit:
                    what = "stalled: no output" if w.seen_output else "did not start: no output"
                    self._dump_stacks(workers)
                    self._fail(w, f"{w.name} on {w.host} {what} for {limit:.0f}s", None)

    def _dump_stacks(self, roles: Sequence[_Role]) -> None:
        """Ask every live local worker for its Python stacks (faulthandler on SIGUSR1, installed
        by ``python -m training worker``), so a stall report shows where each one waited: in a
        dist_sync stall the others wait in ps-lite for the one that stopped."""
        sent = False
        for role in roles:
            # A remote role's local process is its transport's client, not the worker.
            proc = getattr(role.handle, "proc", None) if _is_local(role.host) else None
            if proc is not None and proc.poll() is None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    sent = True
                except OSError:
                    pass
        if sent:
            time.sleep(STACK_DUMP_WAIT_S)

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(r.handle.poll() is not None for r in self.roles):
                bad = [r for r in self.roles if r.handle.returncode != 0]
                if bad:
                    code = bad[0].handle.returncode
                    self._fail(bad[0], f"{bad[0].name} on {bad[0].host} failed after the workers finished: "
                                       f"{_describe_exit(code)}", code)
                return
            time.sleep(POLL_S)
        log.warning("scheduler/servers did not exit within %.0fs after the workers finished; stopping them",
                    DRAIN_TIMEOUT_S)

    def _fail(self, role: _Role | None, what: str, code: int | None) -> None:
        self.events("role_failed", role=role.name if role else "job", host=role.host if role else "",
                    exit_code=code, what=what)
        if role is not None and role.reader:
            role.reader.join(timeout=2.0)
        tail = "\n".join(role.tail) if role is not None else ""
        message = what + (f"\nlast lines of {role.name}:\n{tail}" if tail else "")
        log.error("%s; stopping every role", what)
        raise JobFailed(message, role=role.name if role else "job", host=role.host if role else "",
                        exit_code=code, deterministic=code in DETERMINISTIC_EXIT_CODES)
