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
triggerer (its environment holds no task's credentials).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

READ_TIMEOUT_S = 60.0
# The first record of a freshly started supervisor: its interpreter, imports and first write.
START_TIMEOUT_S = 300.0


def read_job_status(status_uri: str, aws_conn_id: str) -> Any:
    """The status record (``training.launch.status.JobStatus``) read with the connection's S3
    settings, or None when there is none yet."""
    from common import storage
    from plugins.connections import storage_env
    from training.launch.status import JobStatus, read_status

    if not storage.is_s3(status_uri):
        return read_status(status_uri)
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    env = storage_env(aws_conn_id)
    bucket, key = storage.split_s3(status_uri)
    client = boto3.session.Session(aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
                                   aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
                                   aws_session_token=env.get("AWS_SESSION_TOKEN")).client(
        "s3", endpoint_url=env.get("AWS_ENDPOINT_URL_S3"), region_name=env.get("AWS_DEFAULT_REGION"),
        # What common.storage's client uses: path-style addressing, bounded calls.
        config=Config(s3={"addressing_style": "path"}, connect_timeout=10, read_timeout=30,
                      retries={"max_attempts": 3, "mode": "standard"}))
    try:
        return JobStatus.from_json(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def stop_job(cluster: dict[str, Any], grace_s: float) -> list[str]:
    """SIGTERM to the job's supervisor, then whatever is left (``Cluster.stop_job``)."""
    from infra.cluster import attach

    return attach(cluster).stop_job(grace_s=grace_s)


class TrainJobTrigger(BaseTrigger):
    def __init__(self, *, job: dict[str, Any], cluster: dict[str, Any], aws_conn_id: str, poll_s: float,
                 stale_after_s: float, stop_grace_s: float, start_timeout_s: float = START_TIMEOUT_S) -> None:
        super().__init__()
        self.job = job
        self.cluster = cluster
        self.aws_conn_id = aws_conn_id
        self.poll_s = poll_s
        self.stale_after_s = stale_after_s
        self.stop_grace_s = stop_grace_s
        self.start_timeout_s = start_timeout_s
        # What ``report`` logged last: the task log gets a line per change, not per poll.
        self._reported_step, self._reported_restarts = -1, 0

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("plugins.train_trigger.TrainJobTrigger",
                {"job": self.job, "cluster": self.cluster, "aws_conn_id": self.aws_conn_id, "poll_s": self.poll_s,
                 "stale_after_s": self.stale_after_s, "stop_grace_s": self.stop_grace_s,
                 "start_timeout_s": self.start_timeout_s})

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

    async def run(self) -> AsyncIterator[TriggerEvent]:
        uri = self.job["status_uri"]
        while True:
            try:
                status = await asyncio.wait_for(asyncio.to_thread(read_job_status, uri, self.aws_conn_id),
                                                timeout=READ_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - storage trouble: the next read decides, not this one
                self.log.warning("could not read %s: %s", uri, exc)
            else:
                event = self.judge(status, time.time())
                if event is not None:
                    yield event
                    return
                self.report(status, self.log)
            await asyncio.sleep(self.poll_s)

    async def on_kill(self) -> None:
        self.log.info("the task was stopped: stopping job %s", self.job["job_id"])
        stopped = await asyncio.to_thread(stop_job, self.cluster, self.stop_grace_s)
        self.log.info("job %s stopped: %s", self.job["job_id"], stopped)
