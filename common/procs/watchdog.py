"""A role's watch on its supervisor: no role keeps running for long once its supervisor is gone.

The supervisor (``training.launch.supervise``) is the only thing that stops a job's roles in
order. ps-lite cannot lose a node, so roles left behind by a dead supervisor (``kill -9``, an
OOM kill, a crashed host) would go on training unwatched, or wait in ps-lite forever. Each role
therefore runs ``watch_supervisor()`` at its start: a daemon thread that learns of the
supervisor's end from what ``SUPERVISOR_ENV`` names, set by the cluster that started the role:

- ``"stdin"``: the role's standard input is a pipe (or an SSH channel) whose writing end only
  the supervisor holds; end of file means the supervisor is gone. A role started over SSH sees
  it when the supervisor's ``ssh`` client's input closes, with the session; one started through
  ``ip netns exec`` holds the pipe itself. Nothing is ever written to it.
- a ``ProcessIdentity`` (``table pid start``): the supervisor is a process of this machine's
  process table; checked every ``WATCH_INTERVAL_S`` by pid *and* start time, so a recycled pid
  is never taken for it.
- ``record <status uri> <table pid start>`` (``supervised_by_record``): the role runs apart from
  its supervisor (``ec2``: SSM starts it, on another instance), so it reads the job's status
  record every ``WATCH_INTERVAL_S``: gone when the record names another supervisor, reached a
  final state, or has a heartbeat older than ``RECORD_STALE_S`` (the supervisor writes one every
  2 s). A record that cannot be read (storage trouble, which the job itself rides out) judges
  nothing. The hosts' clocks must agree within a second (EC2's do, through its time service).

Not a parent-death signal (``PR_SET_PDEATHSIG``): it delivers one fixed signal to every role at
once, on the death of the parent *thread*, and a Python handler of it never runs while the main
thread waits inside ps-lite. What a role must do instead depends on what it is:

- the checkpoint writer (rank 0; ``preempt_on_supervisor_loss``) is preempted: SIGTERM to
  itself, so the loop's own preemption path (``training.loop``) finishes the current step,
  writes the emergency checkpoint and exits; ``os._exit`` after its grace if it could not.
- every other role (scheduler, servers, other workers, a worker that does not know its rank
  yet) goes on serving while rank 0 may need it: rank 0's Python loop runs ahead of its engine
  (up to ``training.loop.step.LOSS_CHECK_EVERY`` steps), so before its checkpoint it waits for
  pulls that need every peer's pushes up to its own step; the checkpoint itself needs nobody.
  Once rank 0 has exited, its peers block in ps-lite and use no CPU: a peer exits when it has
  been idle (under ``IDLE_CPU_S`` of CPU in ``IDLE_WINDOW_S``) after at least
  ``PEER_LINGER_S``, and after ``PEER_MAX_LINGER_S`` whatever it does.

Either way the role exits ``EXIT_SUPERVISOR_GONE`` (75, ``EX_TEMPFAIL``: the same "retry
resumes" code as a preempted worker's). Without ``SUPERVISOR_ENV`` (a role started by hand)
nothing is watched.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

import psutil

from common.job_states import ACTIVE_STATES
from common.procs.identity import ProcessIdentity

SUPERVISOR_ENV = "MXPIPE_SUPERVISOR"
STDIN = "stdin"
RECORD = "record"
WATCH_INTERVAL_S = 1.0
# A status record whose heartbeat is older than this says its supervisor is gone: two of its
# beats (``training.launch.status.HEARTBEAT_S``, 2 s) missed, so the watch, reading every
# second, sees a death within 5 s. Tighter than a reader that stops a job on it (10 s there):
# here a false alarm costs a restart of the roles, not the job.
RECORD_STALE_S = 4.0
PEER_LINGER_S = 2.0
IDLE_WINDOW_S = 1.0
IDLE_CPU_S = 0.01
# The default checkpoint.preempt_grace_s (30 s) and a margin: rank 0's own bound.
PEER_MAX_LINGER_S = 35.0
# Beyond the checkpoint writer's preemption grace: its last log lines and the exit itself.
WRITER_MARGIN_S = 2.0
EXIT_SUPERVISOR_GONE = os.EX_TEMPFAIL

_lock = threading.Lock()
_writer_grace_s: float | None = None  # set by preempt_on_supervisor_loss


def supervised_by(identity: ProcessIdentity | None) -> dict[str, str]:
    """The role environment entry for a supervisor that is ``identity`` (a process of the role's
    machine) or, with None, the holder of the role's standard input. Empty where this machine
    cannot tell its processes apart (no ``/proc``): its roles go unwatched."""
    if identity is not None and not identity.visible:
        return {}
    return {SUPERVISOR_ENV: identity.to_text() if identity is not None else STDIN}


def supervised_by_record(status_uri: str, identity: ProcessIdentity) -> dict[str, str]:
    """The role environment entry for a supervisor that is ``identity`` on another machine, judged
    by the job's status record at ``status_uri`` (an S3 URI: no whitespace)."""
    return {SUPERVISOR_ENV: f"{RECORD} {status_uri} {identity.to_text()}"}


class SupervisorWatch:
    """What one role knows of its supervisor (``how``: ``SUPERVISOR_ENV``'s value)."""

    def __init__(self, how: str, *, interval_s: float = WATCH_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.record_uri = ""
        if how.startswith(RECORD + " "):
            _, self.record_uri, text = how.split(" ", 2)
            self.identity = ProcessIdentity.from_text(text)  # another machine's: compared, never looked up
            return
        self.identity = None if how == STDIN else ProcessIdentity.from_text(how)
        if self.identity is not None and not self.identity.visible:
            raise ValueError(f"{SUPERVISOR_ENV}: the supervisor {how!r} is not a process of this machine's table")

    def record_says_gone(self) -> str:
        """Why the status record says the supervisor is gone; "" while it is alive, or unreadable."""
        import json

        from common import storage

        try:
            with storage.fail_fast():
                record = json.loads(storage.get_bytes(self.record_uri))
        except Exception:  # noqa: BLE001 - unreadable (storage trouble): judge nothing, read again
            return ""
        ident = self.identity
        named = (record.get("process_table"), record.get("pid"), record.get("pid_started"))
        if named != (ident.table, ident.pid, ident.started):
            return f"the status record {self.record_uri} names another supervisor"
        if record.get("state") not in ACTIVE_STATES:
            return f"the status record {self.record_uri} says the job is {record.get('state')}"
        age = time.time() - float(record.get("heartbeat") or 0.0)
        if age > RECORD_STALE_S:
            return f"its heartbeat in {self.record_uri} is {age:.1f}s old"
        return ""

    def wait(self) -> str:
        """Block until the supervisor is gone; why it is judged gone."""
        if self.record_uri:
            while not (why := self.record_says_gone()):
                time.sleep(self.interval_s)
            return why
        if self.identity is None:
            try:
                while os.read(0, 4096):  # nothing is ever written; read until end of file
                    pass
            except OSError as exc:
                return f"its standard input failed ({exc})"
            return "its standard input (the supervisor's pipe or SSH session) closed"
        while self.identity.running():
            time.sleep(self.interval_s)
        return f"its pid {self.identity.pid} (started at tick {self.identity.started}) is gone"


def ends_itself(pid: int) -> bool:
    """Whether process ``pid`` (of this machine) is a role watching a supervisor that is gone, so
    it is ending itself: worth waiting for rather than signalling (rank 0 may be writing its
    emergency checkpoint, which a SIGTERM to the servers would cut short)."""
    try:
        how = psutil.Process(pid).environ().get(SUPERVISOR_ENV, "")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    if how == STDIN or how.startswith(RECORD + " "):
        return True  # its supervisor's end cannot be seen from here; stop_job has just ended it
    try:
        return bool(how) and ProcessIdentity.from_text(how).running() is False
    except ValueError:
        return False


def preempt_on_supervisor_loss(grace_s: float) -> None:
    """Mark this role as the checkpoint writer: on its supervisor's loss it SIGTERMs itself (the
    loop's preemption path) and gets ``grace_s`` (+ a margin) to exit before ``os._exit``."""
    global _writer_grace_s
    with _lock:
        _writer_grace_s = float(grace_s)


def say(who: str, text: str) -> None:
    """One line from a role's watch (``who``) on its standard error, which nothing may read."""
    try:  # the supervisor read our output: the pipe may be gone with it
        sys.stderr.write(f"{who}: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _say(text: str) -> None:
    say("supervisor watch", text)


def _react(why: str, exit_now: Callable[[int], object]) -> None:
    with _lock:
        writer_grace = _writer_grace_s
    if writer_grace is not None:
        _say(f"the supervisor is gone ({why}): preempting this role (emergency checkpoint, "
             f"grace {writer_grace:.0f}s)")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(writer_grace + WRITER_MARGIN_S)
        _say("the emergency checkpoint did not end within its grace: exiting")
    else:
        _say(f"the supervisor is gone ({why}): exiting once idle (rank 0 may still need this role)")
        _linger()
        _say("idle: exiting")
    exit_now(EXIT_SUPERVISOR_GONE)


def _cpu_s() -> float:
    t = os.times()  # every thread of this process
    return t.user + t.system


def _linger() -> None:
    """Return once this role has been idle for ``IDLE_WINDOW_S`` after ``PEER_LINGER_S``, or
    after ``PEER_MAX_LINGER_S``."""
    started = time.monotonic()
    time.sleep(PEER_LINGER_S - IDLE_WINDOW_S)
    while time.monotonic() - started < PEER_MAX_LINGER_S:
        before = _cpu_s()
        time.sleep(IDLE_WINDOW_S)
        if _cpu_s() - before < IDLE_CPU_S:
            return


def watch_supervisor(environ: Mapping[str, str] | None = None, *,
                     exit_now: Callable[[int], object] = os._exit) -> threading.Thread | None:
    """Start this role's watch (see the module docstring); None when ``SUPERVISOR_ENV`` is unset.
    A malformed value raises ``ValueError`` naming it: a role must not start unwatched by mistake."""
    how = (os.environ if environ is None else environ).get(SUPERVISOR_ENV, "")
    if not how:
        return None
    watch = SupervisorWatch(how)
    thread = threading.Thread(target=lambda: _react(watch.wait(), exit_now), name="supervisor-watch", daemon=True)
    thread.start()
    return thread
