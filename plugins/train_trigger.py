"""The trigger the training operator defers to: it polls the job's status record.

It runs in the triggerer's event loop, so every storage read happens in a thread
(``asyncio.to_thread``) under a bound (``READ_TIMEOUT_S``), one read every ``poll_s``. It fires
one event, ``{"state": ..., "job": ..., "status": ...}``, when the record reaches a final state
(``succeeded`` / ``failed`` / ``stopped``), when an active record's supervisor is gone
(``stale``: the operator stops whatever it left, as a stall): at once when it ran on this
machine (its pid and start time, ``JobStatus.live``), else once its heartbeat is older than
``stale_after_s``, or when the job never shows up in the record within ``start_timeout_s`` (``lost``).
A read that fails is logged and retried: storage trouble is not a job failure, and a job that
outlives it is found again.

``on_kill`` (Airflow 3.3: called when a person marks the deferred task failed or clears it; not
on a triggerer restart) stops the job: SIGTERM to the supervisor, so rank 0 writes its emergency
checkpoint and every role stops (``infra`` ``Cluster.stop_job``). The triggerer gives it
``[triggerer] on_kill_timeout`` (30 s by default); the signal goes out at once and the stop's
own SIGKILL escalation runs on in its thread if that bound passes. The teardown task stops the
job as well, so neither path alone has to succeed.

The status record is read with the run's S3 connection (``aws_conn_id``), resolved in the
triggerer (its environment holds no task's credentials), once per trigger run (``JobStorage``:
a connection lookup per poll logged a credential line per poll).

Each poll also relays the job's new log lines (shipped by its supervisor beside the status
record: ``common.job_log``) into the task's log: the supervisor's and every role's lines, each
epoch's ``EpochDone`` event as its epoch line (loss, the validation metrics, throughput, ETA),
from a position kept beside the log per task try (``LogRelay``) so that a triggerer restart
neither repeats nor skips lines. A relay that cannot read the log is logged once per outage and
never decides anything about the job.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

READ_TIMEOUT_S = 60.0
# How long one S3 client of a poll is used before it is built again (``JobStorage``).
CLIENT_TTL_S = 600.0
# A final relay reads this many times ``common.job_log.MAX_CHUNKS_PER_READ`` chunks at most.
FINAL_READS = 20
# The first record of a freshly started supervisor: its interpreter, imports and first write.
START_TIMEOUT_S = 300.0


class JobStorage:
    """The job's records (status record, shipped log, relay position) read and written with the
    run's S3 connection, through one client per trigger (or non-deferred operator) run.

    Why one client and not one per read: resolving the connection builds the Amazon provider's
    hook, which logs "AWS Connection ... credentials retrieved" at INFO each time; per poll that
    was a line every ``poll_s`` in the task's log. The client is built again after
    ``CLIENT_TTL_S``: a connection that assumes a role hands out frozen credentials of a session
    that may be as short as 15 minutes. boto3 clients are thread-safe (the trigger reads in
    ``asyncio.to_thread``); the lock only keeps two threads from building one each."""

    def __init__(self, aws_conn_id: str) -> None:
        self.aws_conn_id = aws_conn_id
        self._client: Any = None
        self._built_at = 0.0
        self._lock = threading.Lock()

    def client(self) -> Any:
        with self._lock:
            if self._client is None or time.monotonic() - self._built_at > CLIENT_TTL_S:
                self._client, self._built_at = self._build(), time.monotonic()
            return self._client

    def _build(self) -> Any:
        import boto3
        from botocore.config import Config

        from plugins.connections import storage_env

        env = storage_env(self.aws_conn_id)
        return boto3.session.Session(aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
                                     aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
                                     aws_session_token=env.get("AWS_SESSION_TOKEN")).client(
            "s3", endpoint_url=env.get("AWS_ENDPOINT_URL_S3"), region_name=env.get("AWS_DEFAULT_REGION"),
            # What common.storage's client uses: path-style addressing, bounded calls.
            config=Config(s3={"addressing_style": "path"}, connect_timeout=10, read_timeout=30,
                          retries={"max_attempts": 3, "mode": "standard"}))

    def get(self, uri: str) -> bytes | None:
        """The object at ``uri``, or None where there is none."""
        from common import storage
        from common.job_log import storage_get

        if not storage.is_s3(uri):
            return storage_get(uri)
        from botocore.exceptions import ClientError

        bucket, key = storage.split_s3(uri)
        try:
            return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def put(self, uri: str, data: bytes) -> None:
        from common import storage

        if not storage.is_s3(uri):
            storage.put_bytes(uri, data)
            return
        bucket, key = storage.split_s3(uri)
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def status(self, status_uri: str) -> Any:
        """The status record (``training.launch.status.JobStatus``), or None when there is none yet."""
        from training.launch.status import JobStatus

        data = self.get(status_uri)
        return JobStatus.from_json(data) if data is not None else None


def read_job_status(status_uri: str, aws_conn_id: str) -> Any:
    """The status record read with the connection's S3 settings (one read: a poll keeps a
    ``JobStorage``), or None when there is none yet."""
    return JobStorage(aws_conn_id).status(status_uri)


class LogRelay:
    """The job's shipped log (``common.job_log``) relayed into the task's log from a position
    that outlives the triggerer.

    The position (the next chunk's number) is kept beside the log, per task try
    (``relayed/try-N.json``): a trigger's kwargs are written once, when the task defers, and
    Airflow 3.3 gives a task's trigger no state store of its own (only event triggers get
    ``asset_state_store``), so a triggerer that restarts (or another that takes the trigger up)
    rebuilds the trigger from kwargs that do not know how far it got. The position is written
    before the lines are logged: a failed write relays nothing and the same chunks are read
    again next poll (no repeat); only a process killed between that write and the logging of
    lines already in memory loses them. A new try starts at 0: its log shows the job from its
    start."""

    def __init__(self, job: dict[str, Any], relay_try: int) -> None:
        from common.job_log import log_prefix

        self.prefix = log_prefix(job["status_uri"], job["job_id"])
        self.cursor_uri = f"{self.prefix}/relayed/try-{relay_try}.json"
        self.seq: int | None = None
        self.unreadable = False

    def fetch(self, store: JobStorage, *, until_end: bool = False) -> list[str]:
        """The new lines as a task log shows them (epoch events as epoch lines: ``relay_line``),
        their position saved; with ``until_end``, every chunk there is (bounded by
        ``FINAL_READS``), else at most one read's worth."""
        import json

        from common.job_log import read_new, relay_line

        if self.seq is None:
            saved = store.get(self.cursor_uri)
            self.seq = int(json.loads(saved)["seq"]) if saved else 0
        lines: list[str] = []
        seq = self.seq
        for _ in range(FINAL_READS if until_end else 1):
            got, after = read_new(self.prefix, seq, get=store.get)
            lines += got
            if after == seq:
                break
            seq = after
        if seq != self.seq:
            store.put(self.cursor_uri, json.dumps({"seq": seq}).encode())
            self.seq = seq
        return [text for line in lines if (text := relay_line(line)) is not None]

    def emit(self, lines: list[str], log: logging.Logger) -> None:
        for line in lines:
            log.info("%s", line)

    def failed(self, exc: Exception, log: logging.Logger) -> None:
        if not self.unreadable:  # once per outage, not once per poll
            log.warning("could not relay the job's log %s/: %s", self.prefix, exc)
        self.unreadable = True


def stop_job(cluster: dict[str, Any], grace_s: float) -> list[str]:
    """SIGTERM to the job's supervisor, then whatever is left (``Cluster.stop_job``)."""
    from infra.cluster import attach

    return attach(cluster).stop_job(grace_s=grace_s)


def _final_states() -> frozenset[str]:
    from training.launch.status import FINAL_STATES

    return frozenset(FINAL_STATES)


class TrainJobTrigger(BaseTrigger):
    def __init__(self, *, job: dict[str, Any], cluster: dict[str, Any], aws_conn_id: str, poll_s: float,
                 stale_after_s: float, stop_grace_s: float, start_timeout_s: float = START_TIMEOUT_S,
                 relay_try: int = 0) -> None:
        super().__init__()
        self.job = job
        self.cluster = cluster
        self.aws_conn_id = aws_conn_id
        self.poll_s = poll_s
        self.stale_after_s = stale_after_s
        self.stop_grace_s = stop_grace_s
        self.start_timeout_s = start_timeout_s
        self.relay_try = relay_try
        self.relay = LogRelay(job, relay_try)
        # What ``report`` logged last: the task log gets a line per change, not per poll.
        self._reported_step, self._reported_restarts = -1, 0

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("plugins.train_trigger.TrainJobTrigger",
                {"job": self.job, "cluster": self.cluster, "aws_conn_id": self.aws_conn_id, "poll_s": self.poll_s,
                 "stale_after_s": self.stale_after_s, "stop_grace_s": self.stop_grace_s,
                 "start_timeout_s": self.start_timeout_s, "relay_try": self.relay_try})

    def _event(self, state: str, status: Any = None, why: str = "") -> TriggerEvent:
        return TriggerEvent({"state": state, "job": self.job, "why": why,
                             "status": asdict(status) if status is not None else None})

    def judge(self, status: Any, now: float) -> TriggerEvent | None:
        """The event this record calls for, or None (keep polling)."""
        from training.launch.status import FINAL_STATES

        job_id = self.job["job_id"]
        if status is None or status.job_id != job_id:
            waited = now - float(self.job["submitted_at"])
            if waited > self.start_timeout_s:
                return self._event("lost", status, f"job {job_id} wrote no status record within "
                                                   f"{self.start_timeout_s:.0f}s of its start")
            return None
        if status.state in FINAL_STATES:
            return self._event(status.state, status)
        if not status.live(now, self.stale_after_s):
            # Seen gone on this machine (pid and start time) at once; elsewhere by its heartbeat.
            bound = "" if status.supervisor_running() is False else f" (bound {self.stale_after_s:.0f}s)"
            return self._event("stale", status, f"job {job_id}: {status.gone_reason(now)}{bound}")
        return None

    def report(self, status: Any, log: logging.Logger) -> None:
        """Log what changed in the job's record since the last read: a restart in place (with
        the failure it followed), the step reached."""
        if status is None or status.job_id != self.job["job_id"]:
            return
        if status.restarts > self._reported_restarts:
            self._reported_restarts = status.restarts
            log.warning("job %s restarted every role in place (restart %d; %d in a row without a new checkpoint) "
                        "after: %s", status.job_id, status.restarts, status.restarts_without_progress,
                        status.last_restart_reason)
        if status.global_step != self._reported_step:
            self._reported_step = status.global_step
            log.info("job %s %s: epoch %d, global step %d", status.job_id, status.state, status.epoch,
                     status.global_step)

    def read(self, store: JobStorage, *, until_end: bool = False) -> tuple[Any, list[str], Exception | None]:
        """The status record, and the job log's new lines (or why they could not be read: a
        relay that fails is not a failed read of the record). Blocking."""
        status = store.status(self.job["status_uri"])
        final = until_end or (status is not None and status.job_id == self.job["job_id"]
                              and status.state in _final_states())
        try:
            return status, self.relay.fetch(store, until_end=final), None
        except Exception as exc:  # noqa: BLE001 - storage trouble: the same chunks are read next poll
            return status, [], exc

    def step(self, read: tuple[Any, list[str], Exception | None], log: logging.Logger) -> TriggerEvent | None:
        """What one read logs (the relayed lines, what changed in the record) and the event it
        calls for, if any."""
        status, lines, relay_error = read
        self.relay.emit(lines, log)
        if relay_error is not None:
            self.relay.failed(relay_error, log)
        else:
            self.relay.unreadable = False
        event = self.judge(status, time.time())
        if event is None:
            self.report(status, log)
        return event

    async def run(self) -> AsyncIterator[TriggerEvent]:
        uri = self.job["status_uri"]
        store = JobStorage(self.aws_conn_id)  # one client (one credential lookup) for the whole run
        while True:
            try:
                read = await asyncio.wait_for(asyncio.to_thread(self.read, store), timeout=READ_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - storage trouble: the next read decides, not this one
                self.log.warning("could not read %s: %s", uri, exc)
            else:
                event = self.step(read, self.log)
                if event is not None:
                    yield event
                    return
            await asyncio.sleep(self.poll_s)

    async def on_kill(self) -> None:
        self.log.info("the task was stopped: stopping job %s", self.job["job_id"])
        stopped = await asyncio.to_thread(stop_job, self.cluster, self.stop_grace_s)
        self.log.info("job %s stopped: %s", self.job["job_id"], stopped)
