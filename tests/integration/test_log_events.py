"""The readers of a job's log read the workers' events (``common.events``), never their human text.

A real two-worker job is killed at a step and retried (it resumes from a checkpoint), with the
supervisor's event log on. Over that log the readers compute: the status record's progress
(``training.launch.status``), live tracking's epoch records and cost figures
(``training.tracking.live``, ``training.tracking.cost``), the attempts, failure timeline and
goodput (``testkit/timeline.py``). With every human line reworded, or removed, they must
compute exactly the same: rewording a log message cannot break them.
"""
import json

import pytest

from testkit.timeline import attempts, goodput
from common import storage
from common.events import EVENT_MARK
from training.launch.launcher import PROGRESS_ROLE, JobFailed
from training.launch.status import JobStatus, StatusWriter
from training.tracking.live import LiveRun

from testkit.local_jobs import make_job, run_job, shard_digits

pytestmark = pytest.mark.integration

KILL_STEP = 30


@pytest.fixture(scope="module")
def digits_shards(s3_server, digits_csv):
    return shard_digits(f"s3://{s3_server.bucket}/test-log-events", digits_csv)


def _human(event: dict) -> bool:
    return event["event"] == "line" and EVENT_MARK not in event["text"]


def reworded(events: list[dict]) -> list[dict]:
    """Every human line said differently: its words in reverse order, upper case."""
    return [{**e, "text": " ".join(reversed(e["text"].split())).upper()} if _human(e) else e for e in events]


def without_human_lines(events: list[dict]) -> list[dict]:
    return [e for e in events if not _human(e)]


def readings(events: list[dict], kill_t: float, status_uri: str) -> dict:
    """What every reader of the log makes of it, per attempt where the reader lives per attempt
    (one supervisor, status writer and live run each)."""
    status, live = [], []
    starts = [i for i, e in enumerate(events) if e["event"] == "job_start"] + [len(events)]
    for begin, end in zip(starts, starts[1:]):
        # progress() only notes the step (never writes), and the live run is never started: no MLflow.
        writer = StatusWriter(status_uri, JobStatus(state="running", job_id="j"))
        run = LiveRun(tracking_uri="http://127.0.0.1:9", experiment="x", run_name="r", find_tags={"a": "b"})
        for e in events[begin:end]:
            if e["event"] != "line":
                continue
            if e["role"] == PROGRESS_ROLE:
                writer.progress(e["text"])
            run.on_line(e["role"], e["text"])
        status.append((writer.status.epoch, writer.status.global_step))
        live.append({"rank0": run._rank0, "records": run._records, "cost": run.cost.metrics()})
    timeline = [(a.resumed_from, a.points, a.committed) for a in attempts(events)]
    return {"status": status, "live": live, "attempts": timeline, "goodput": goodput(events, [kill_t])}


def test_readers_compute_the_same_with_the_human_lines_reworded_or_removed(digits_shards, s3_prefix, tmp_path):
    cfg, shards = digits_shards
    job = make_job(cfg, shards, s3_prefix, optim={"epochs": 2}, checkpoint={"every_n_steps": 7},
                   cluster={"max_restarts_without_progress": 0})  # killed, then retried as a new job
    log_file, once = tmp_path / "events.jsonl", tmp_path / "fault-fired"
    # The delay (on worker 1, so the whole dist_sync job) spans more than one progress interval.
    env = {"MXPIPE_EVENTS_FILE": str(log_file), "MXPIPE_FAULT_KILL_STEP": str(KILL_STEP),
           "MXPIPE_FAULT_KILL_RANK": "1", "MXPIPE_FAULT_ONCE_FILE": str(once), "MXPIPE_FAULT_STEP_DELAY_S": "0.25"}
    with pytest.raises(JobFailed):
        run_job(job, s3_prefix, tmp_path, env=env)
    run_job(job, s3_prefix, tmp_path, env=env)  # the once-file makes the retry run clean
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
    kill_t = once.stat().st_mtime
    status_uri = str(tmp_path / "status.json")

    original = readings(events, kill_t, status_uri)
    # Not vacuous: the readers found the job's progress, records, resume, checkpoints and failure.
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    (_, first_step), (last_epoch, last_step) = original["status"]
    assert 0 < first_step <= KILL_STEP and (last_epoch, last_step) == (2, metrics["global_step"]), original["status"]
    # Rank 0's epoch records, epoch 0 from the killed attempt, epoch 1 from its retry.
    assert [r["epoch"] for attempt in original["live"] for r in attempt["records"]] == [0, 1]
    assert original["live"][1]["records"][-1]["val_accuracy"] == metrics["history"][-1]["val_accuracy"]
    (first, second) = original["attempts"]
    assert first[1] and first[2] and 0 < second[0] < KILL_STEP and second[0] in [s for _, s in first[2]]
    assert original["live"][1]["cost"]["cost.steps_trained"] == metrics["global_step"] - second[0]
    (failure,) = original["goodput"]["failures"]
    assert failure["resumed_from_step"] == second[0] and 0 < original["goodput"]["goodput"] < 1

    assert sum(map(_human, events)) > 20
    assert readings(reworded(events), kill_t, status_uri) == original
    assert readings(without_human_lines(events), kill_t, status_uri) == original
