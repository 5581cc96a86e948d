"""The status record of a supervised job: one small JSON object at the run's storage prefix.

The supervisor (``python -m training supervise``) is the only writer; the Airflow operator and
its trigger read it. Every write replaces the whole object (``common.storage.put_bytes``: an S3
put, or a local write renamed into place), so a reader sees one complete record or the one
before it, never a torn one. Writes are rate-bounded (``StatusWriter.min_interval_s``) except
for a change of state, which is always written at once. The supervisor's heartbeat and rank 0's
progress are written from a thread of their own (``StatusWriter.start_beats``): a write that
waits on an unreachable storage must never hold up the relay of the roles' lines, the event log
or the detection of a failed or stalled role.

Fields: ``state`` (``STATES``), ``job_id`` (unique per supervisor start), ``attempt`` (the
Airflow try that started it, 0 outside Airflow), ``global_step`` and ``epoch`` (from rank 0's
events), ``heartbeat`` (Unix time of the last write; a live supervisor writes at least every
``HEARTBEAT_S``), ``error`` and ``deterministic`` (on failure: whether a retry can help), and
``host`` / ``pid`` of the supervisor, which is what a stop signals (with ``process_table`` and
``pid_started``, its identity: ``live`` checks it by pid and start time on its own machine), and on a role's failure
``role``, ``role_host`` and ``exit_code`` (negative for a signal; None for a stall); and the
in-place restarts (``restarts``, ``restarts_without_progress``, ``last_restart_reason``).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from common import storage
from common.events import EpochDone, EventError, Progress, parse_event
from common.job_states import ACTIVE_STATES, FAILED, FINAL_STATES, RUNNING, STARTING, STATES, STOPPED, SUCCEEDED
from common.procs.identity import ProcessIdentity

# A live supervisor refreshes its heartbeat at least this often (with its progress, if any): a
# 3-day run writes about 130k small objects. MIN_WRITE_INTERVAL_S bounds ``update``'s writes.
HEARTBEAT_S = 2.0
MIN_WRITE_INTERVAL_S = 5.0
# A heartbeat older than this means the supervisor is gone (crashed host, kill -9): its job is
# not live, whatever its state says. Only for a supervisor that this machine cannot inspect
# (``JobStatus.supervisor_running``: one on this machine is judged by pid and start time, at
# once). Five heartbeats: one storage put riding out botocore's retries, or a second of clock
# skew between the supervisor's host and the reader's, must not read as a death (which stops a
# healthy job); a bound of 5 s would not leave that margin. Its roles do not wait for it: they
# end themselves within seconds of their supervisor (``common.procs.watchdog``).
STALE_AFTER_S = 5 * HEARTBEAT_S


class StatusError(RuntimeError):
    """A status record that cannot be read or is malformed."""


@dataclass(frozen=True)
class JobStatus:
    state: str
    job_id: str
    attempt: int = 0
    global_step: int = 0
    epoch: int = 0
    heartbeat: float = 0.0
    started_at: float = 0.0
    error: str = ""
    deterministic: bool = False
    host: str = ""
    pid: int = 0
    # The supervisor's process table and start time (clock ticks since boot): with ``pid``, what
    # tells it apart from a later process with its pid, and this machine from another.
    process_table: str = ""
    pid_started: int = 0
    role: str = ""
    role_host: str = ""
    exit_code: int | None = None
    # In-place restarts of every role (training.launch.restarts): how many, how many of the last
    # ones in a row committed no new checkpoint, and the failure the last one followed.
    restarts: int = 0
    restarts_without_progress: int = 0
    last_restart_reason: str = ""
    # How a succeeded sweep trial ended (training.loop.pruning): "pruned" or "completed"; empty
    # for any other job.
    outcome: str = ""

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise StatusError(f"unknown job state {self.state!r}; expected one of {STATES}")

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    def age_s(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.heartbeat

    # -- liveness: the supervisor by pid and start time where this machine can see it ----------

    def supervisor_running(self) -> bool | None:
        """Whether the supervisor process still runs, judged by pid and start time on its own
        machine (``common.procs.identity``); None where this machine cannot see it (another host
        or container, or a record without its identity)."""
        if not self.pid_started:
            return None
        return ProcessIdentity(self.process_table, self.pid, self.pid_started).running()

    def live(self, now: float | None = None, stale_after_s: float = STALE_AFTER_S) -> bool:
        """Active, and its supervisor running: known at once where this machine can see it
        (``supervisor_running``; its heartbeat may age through a storage outage the job rides
        out), else heard from within ``stale_after_s``."""
        if not self.active:
            return False
        running = self.supervisor_running()
        return running if running is not None else self.age_s(now) <= stale_after_s

    def gone_reason(self, now: float | None = None) -> str:
        """Why an active record's job is not live (for messages)."""
        if self.supervisor_running() is False:
            return f"its supervisor (pid {self.pid} on {self.host}, this machine) is gone"
        return f"its supervisor on {self.host} has not written its status for {self.age_s(now):.0f}s"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> "JobStatus":
        try:
            raw = json.loads(data)
            return cls(**raw)
        except (ValueError, TypeError) as exc:
            raise StatusError(f"malformed job status record: {exc}") from exc


def read_status(uri: str) -> JobStatus | None:
    """The record at ``uri``, or None when there is none yet."""
    try:
        data = storage.get_bytes(uri)
    except FileNotFoundError:
        return None
    return JobStatus.from_json(data)


def progress_of(line: str) -> tuple[int, int] | None:
    """``(epoch, global_step)`` of a rank-0 progress or epoch-done event line
    (``common.events``), else None. Raises ``EventError`` for a malformed event line."""
    event = parse_event(line)
    if isinstance(event, Progress):
        return event.epoch, event.global_step
    if isinstance(event, EpochDone):
        return event.epoch + 1, event.global_step  # the epoch that starts next
    return None


class StatusWriter:
    """The supervisor's side: keeps the current record and writes it, rate-bounded.

    ``update`` changes fields and writes when the state changed or ``min_interval_s`` passed;
    ``beat`` writes when ``heartbeat_s`` passed (or noted progress is due); ``progress`` only
    notes rank 0's step, for the beats to write. A write holds no lock a caller of ``progress``
    waits on, so a slow one delays the record alone. A failed write is logged by the caller's
    ``on_error`` and retried at the next call: storage trouble must not end a healthy job (the
    reader then sees an old heartbeat, which is the truth).
    """

    def __init__(self, uri: str, status: JobStatus, *, min_interval_s: float = MIN_WRITE_INTERVAL_S,
                 heartbeat_s: float = HEARTBEAT_S, on_error: Any = None) -> None:
        self.uri = uri
        self.status = status
        self.min_interval_s = min_interval_s
        self.heartbeat_s = heartbeat_s
        self.on_error = on_error
        self.lock = threading.Lock()  # the record and its bookkeeping; never held across a write
        self.write_lock = threading.Lock()  # one write at a time
        self.written_at = float("-inf")
        self.dirty = True
        self._stop_beats: threading.Event | None = None

    def update(self, **fields: Any) -> None:
        with self.lock:
            state_changed = self._change(**fields)
            due = state_changed or time.monotonic() - self.written_at >= self.min_interval_s
        if due:
            self._write()

    def beat(self) -> None:
        with self.lock:
            since = time.monotonic() - self.written_at
            due = since >= self.heartbeat_s or (self.dirty and since >= self.min_interval_s)
        if due:
            self._write()

    def start_beats(self, interval_s: float) -> None:
        """Call ``beat`` every ``interval_s`` from a daemon thread until ``stop_beats``."""
        stop = self._stop_beats = threading.Event()

        def beats() -> None:
            while not stop.wait(interval_s):
                self.beat()

        threading.Thread(target=beats, name="status-beats", daemon=True).start()

    def stop_beats(self) -> None:
        """End the beats; a write in flight finishes on its own (the next write waits for it)."""
        if self._stop_beats is not None:
            self._stop_beats.set()

    def finish(self, state: str, *, attempts: int = 5, wait_s: float = 2.0, **fields: Any) -> bool:
        """Write the final ``state``, retrying a failed write (bounded: ``attempts`` × ``wait_s``):
        a reader that never sees it decides from the stale heartbeat instead. True if written."""
        if state not in FINAL_STATES:
            raise StatusError(f"{state!r} is not a final job state {sorted(FINAL_STATES)}")
        self.update(state=state, **fields)
        for _ in range(attempts - 1):
            if not self.dirty:
                break
            time.sleep(wait_s)
            self._write()
        return not self.dirty

    def progress(self, line: str) -> None:
        """Note rank 0's step and epoch from one of its log lines (most are not events: a
        substring test). Never writes: the beats do, within the rate bound."""
        try:
            got = progress_of(line)
        except EventError:  # the relayed line is in the log; live tracking reports it
            return
        if got is not None:
            with self.lock:
                if got[1] >= self.status.global_step:
                    self._change(epoch=got[0], global_step=got[1])

    def _change(self, **fields: Any) -> bool:
        """Apply ``fields`` to the record (the caller holds ``lock``); True if the state changed."""
        new = replace(self.status, **fields)
        state_changed = new.state != self.status.state
        self.dirty = self.dirty or new != self.status
        self.status = new
        return state_changed

    def _write(self) -> None:
        with self.write_lock:
            with self.lock:
                record = self.status = replace(self.status, heartbeat=time.time())
            try:
                storage.put_bytes(self.uri, record.to_json())
            except Exception as exc:  # noqa: BLE001 - any storage error: keep supervising, retry later
                if self.on_error is not None:
                    self.on_error(exc)
                return
            with self.lock:
                self.written_at = time.monotonic()
                self.dirty = self.status != record  # a change noted during the write is still due
