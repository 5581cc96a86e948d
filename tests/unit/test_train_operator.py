"""The training operator and its trigger without a scheduler: what the trigger fires for each
status record, that its polling ends on a final record, how ``execute_complete`` maps an end
(success → the train dict, deterministic → no retry, stale → stop as a stall, else retryable),
that a second job never starts beside a live one, and that a deferral timeout stops the job and
fails without a retry. The real-scheduler paths are in tests/integration/test_train_operator_stack.py."""
import asyncio
import json
import time
from datetime import timedelta

import pytest

from training.launch.status import FAILED, RUNNING, SUCCEEDED, JobStatus

pytestmark = pytest.mark.unit


def _trigger(tmp_path, **kw):
    from plugins.train_trigger import TrainJobTrigger

    job = {"job_id": "1-a", "status_uri": str(tmp_path / "status.json"), "submitted_at": time.time()}
    return TrainJobTrigger(job=job, cluster={"backend": "local"}, aws_conn_id="aws_default", poll_s=0.05,
                           stale_after_s=60, stop_grace_s=5, **kw)


def _write(tmp_path, **fields):
    (tmp_path / "status.json").write_bytes(JobStatus(**{"job_id": "1-a", "heartbeat": time.time(), **fields}).to_json())


def test_trigger_judges_each_record(tmp_path):
    t = _trigger(tmp_path, start_timeout_s=100)
    now = time.time()
    assert t.judge(None, now) is None  # not started yet
    assert t.judge(JobStatus(state=SUCCEEDED, job_id="0-old", heartbeat=now), now) is None  # the previous job's
    assert t.judge(JobStatus(state=RUNNING, job_id="1-a", heartbeat=now - 5), now) is None
    assert t.judge(JobStatus(state=SUCCEEDED, job_id="1-a", heartbeat=now), now).payload["state"] == SUCCEEDED
    stale = t.judge(JobStatus(state=RUNNING, job_id="1-a", heartbeat=now - 61, host="h"), now).payload
    assert stale["state"] == "stale" and "has not written its status for 61s" in stale["why"]
    lost = t.judge(None, now + 101).payload
    assert lost["state"] == "lost" and "no status record within 100s" in lost["why"]


def test_the_task_log_gets_a_line_per_restart_in_place_and_per_new_step(tmp_path, caplog):
    import logging

    trigger, log = _trigger(tmp_path), logging.getLogger("test.task")
    caplog.set_level(logging.INFO, logger="test.task")
    base = JobStatus(state=RUNNING, job_id="1-a", global_step=10, epoch=1)
    trigger.report(base, log)
    trigger.report(base, log)  # nothing changed: no line
    restarted = JobStatus(state=RUNNING, job_id="1-a", global_step=12, epoch=1, restarts=1,
                          last_restart_reason="worker-1 on 127.0.0.1 failed: killed by SIGKILL")
    trigger.report(restarted, log)
    trigger.report(JobStatus(state=RUNNING, job_id="other", restarts=5), log)  # another job's record
    assert [r.getMessage() for r in caplog.records] == [
        "job 1-a running: epoch 1, global step 10",
        "job 1-a restarted every role in place (restart 1; 0 in a row without a new checkpoint) after: "
        "worker-1 on 127.0.0.1 failed: killed by SIGKILL",
        "job 1-a running: epoch 1, global step 12"]
    assert caplog.records[1].levelname == "WARNING"


def test_trigger_knows_a_supervisor_gone_on_this_machine_at_once(tmp_path):
    import subprocess
    import sys

    from common.procs.identity import ProcessIdentity

    t = _trigger(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    them = ProcessIdentity.of(child.pid)
    rec = JobStatus(state=RUNNING, job_id="1-a", heartbeat=time.time(), host="h", pid=them.pid,
                    process_table=them.table, pid_started=them.started)
    assert t.judge(rec, time.time()) is None
    child.kill()
    child.wait(timeout=30)
    gone = t.judge(rec, time.time()).payload  # its heartbeat is fresh: no waiting for the bound
    assert gone["state"] == "stale" and f"its supervisor (pid {them.pid} on h, this machine) is gone" in gone["why"]


def test_trigger_polls_until_the_record_is_final(tmp_path):
    t = _trigger(tmp_path)
    _write(tmp_path, state=RUNNING, global_step=5)

    async def first_event():
        gen = t.run()
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.3)
        assert not task.done()  # running: still polling
        _write(tmp_path, state=FAILED, error="worker-1 failed", deterministic=True)
        return await asyncio.wait_for(task, 10)

    event = asyncio.run(first_event()).payload
    assert event["state"] == FAILED and event["status"]["deterministic"] and event["job"]["job_id"] == "1-a"


def test_trigger_round_trips_through_serialize(tmp_path):
    from plugins.train_trigger import TrainJobTrigger

    t = _trigger(tmp_path)
    path, kwargs = t.serialize()
    assert path == "plugins.train_trigger.TrainJobTrigger"
    assert TrainJobTrigger(**json.loads(json.dumps(kwargs))).serialize() == (path, kwargs)


def _operator(**kw):
    from plugins.train_operator import TrainJobOperator

    return TrainJobOperator(task_id="train", cluster={}, shards={}, config={},
                            warm_start={"reference": "", "checkpoint": None}, **kw)


def test_execute_complete_maps_each_end(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    from plugins.train_operator import TrainingFailed

    op = _operator()
    job = {"job_id": "1-a", "cluster": {"backend": "local"}}
    monkeypatch.setattr(op, "get_job_result", lambda j, ctx: {"global_step": 7, "job": j["job_id"]})
    stops = []
    monkeypatch.setattr(op, "_stop", lambda j, why: stops.append(why))
    assert op.execute_complete({}, {"job": job, "state": SUCCEEDED, "status": {}}) == {"global_step": 7, "job": "1-a"}
    with pytest.raises(AirflowFailException, match="NaN loss"):
        op.execute_complete({}, {"job": job, "state": FAILED, "status": {"deterministic": True, "error": "NaN loss"}})
    with pytest.raises(TrainingFailed, match="killed by SIGKILL"):
        op.execute_complete({}, {"job": job, "state": FAILED, "status": {"deterministic": False,
                                                                  "error": "worker-1 killed by SIGKILL"}})
    with pytest.raises(TrainingFailed, match="stalled: gone"):
        op.execute_complete({}, {"job": job, "state": "stale", "why": "gone", "status": {}})
    assert stops == ["gone"]
    with pytest.raises(TrainingFailed, match="ended lost"):
        op.execute_complete({}, {"job": job, "state": "lost", "why": "no record", "status": None})


def test_submit_reconnects_to_a_live_job_rather_than_starting_a_second(monkeypatch, tmp_path):
    import plugins.pipeline_tasks as tasks

    status_uri = str(tmp_path / "status.json")
    monkeypatch.setattr(tasks, "prepare_job", lambda *a, **k: {"status_uri": status_uri, "cluster": {"backend": "x"}})
    live = JobStatus(state=RUNNING, job_id="1-first", heartbeat=time.time(), started_at=123.0)
    (tmp_path / "status.json").write_bytes(live.to_json())
    op = _operator()
    ctx = {"dag": type("D", (), {"dag_id": "d"}), "run_id": "r", "ti": type("T", (), {"try_number": 2}),
           "params": {}}
    job = op.submit_job(ctx)
    assert (job["job_id"], job["submitted_at"]) == ("1-first", 123.0)  # no infra call: nothing started
    assert op.get_job_status(job, ctx) == RUNNING and op.is_job_active(RUNNING)
    (tmp_path / "status.json").write_bytes(JobStatus(state=RUNNING, job_id="1-first", heartbeat=1.0).to_json())
    assert op.get_job_status(job, ctx) == "stale" and not op.is_job_active("stale")


def test_deferral_timeout_stops_the_job_and_fails_without_a_retry(monkeypatch):
    from airflow.sdk.exceptions import AirflowFailException

    op = _operator(execution_timeout=timedelta(seconds=5))
    stops = []
    monkeypatch.setattr(op, "_stop", lambda j, why: stops.append((j["job_id"], why)))
    store = {"train_job": {"job_id": "1-a"}}
    ctx = {"task_state_store": type("S", (), {"get": staticmethod(store.get)})}
    with pytest.raises(AirflowFailException, match="execution_timeout"):
        op.resume_execution("__fail__", {"error": "Trigger timeout"}, ctx)
    assert stops and stops[0][0] == "1-a" and "execution_timeout" in stops[0][1]


def _ctx():
    return {"params": {}, "ti": None}


def test_without_deferral_the_task_polls_the_record_itself_with_the_triggers_rules(monkeypatch, tmp_path):
    """``deferrable=False``: no TaskDeferred; the task reads the record until it is final and
    returns what ``execute_complete`` makes of it (a reconnecting retry returns it as is)."""
    import threading

    op = _operator(deferrable=False, poll_s=0.05)
    monkeypatch.setattr(op, "_stop_grace_s", lambda: 5.0)
    monkeypatch.setattr(op, "get_job_result", lambda j, ctx: {"global_step": 9, "job": j["job_id"]})
    job = {"job_id": "1-a", "status_uri": str(tmp_path / "status.json"), "submitted_at": time.time(),
           "cluster": {"backend": "local"}}
    _write(tmp_path, state=RUNNING, global_step=3)
    threading.Timer(0.3, lambda: _write(tmp_path, state=SUCCEEDED, global_step=9)).start()
    started = time.monotonic()
    assert op.poll_until_complete(job, _ctx()) == {"global_step": 9, "job": "1-a"}
    assert 0.3 <= time.monotonic() - started < 5
    _write(tmp_path, state=FAILED, error="NaN loss at step 4", deterministic=True)
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match="NaN loss"):
        op.poll_until_complete(job, _ctx())


def test_a_long_execution_timeout_reaches_the_deferral_counted_from_the_jobs_start(monkeypatch, tmp_path):
    """A 3-day ``execution_timeout`` (``MXPIPE_TRAIN_TIMEOUT_S=259200``) is the deferral's
    timeout, less the time the job has already run (a reconnect does not reset it)."""
    from airflow.sdk.exceptions import TaskDeferred

    op = _operator(execution_timeout=timedelta(days=3))
    monkeypatch.setattr(op, "_stop_grace_s", lambda: 5.0)
    job = {"job_id": "1-a", "status_uri": str(tmp_path / "status.json"), "submitted_at": time.time() - 7200,
           "cluster": {"backend": "local"}}
    with pytest.raises(TaskDeferred) as deferred:
        op.poll_until_complete(job, _ctx())
    left = deferred.value.timeout.total_seconds()
    assert 259200 - 7200 - 60 < left <= 259200 - 7200
    assert deferred.value.trigger.job["job_id"] == "1-a"


@pytest.mark.parametrize("poll_s", [0, -1.0])
def test_a_poll_interval_that_is_not_positive_is_refused(poll_s):
    with pytest.raises(ValueError, match=f"poll_s must be a number of seconds > 0, got {poll_s!r}"):
        _operator(poll_s=poll_s)


def test_an_operator_never_resolves_the_warm_start_itself():
    """A run's config comes with the run's resolution of its warm start (check_reuse's XCom), a
    sweep trial carries its own (plan_trials'): a DAG wired otherwise fails when it is parsed."""
    from plugins.train_operator import TrainJobOperator

    with pytest.raises(ValueError, match="warm start resolution"):
        TrainJobOperator(task_id="train", cluster={}, shards={}, config={})
    with pytest.raises(ValueError, match="a sweep trial carries its own"):
        TrainJobOperator(task_id="train", cluster={}, shards={}, trial={"config": {}},
                         warm_start={"reference": "", "checkpoint": None})



def _ship(status_uri: str, job_id: str, *messages: str) -> None:
    """Lines of a job's log as its supervisor ships them (one chunk per call)."""
    import logging

    from common.job_log import LogShipper, log_prefix, read_new

    prefix = log_prefix(status_uri, job_id)
    shipper = LogShipper(prefix, flush_s=3600)
    shipper.seq = read_new(prefix, 0, max_chunks=10**6)[1]  # after the chunks already there
    logger = logging.getLogger("training.launch.launcher")
    logger.addHandler(shipper)
    try:
        for message in messages:
            logger.warning("%s", message)
    finally:
        logger.removeHandler(shipper)
        shipper.close()


class _Lines:
    """A task log's lines (Airflow's logging setup takes caplog's handler off once it is imported)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args)

    warning = info


def test_the_trigger_relays_the_jobs_log_and_a_restarted_trigger_goes_on_where_it_stopped(tmp_path):
    from common.events import EpochDone, Progress, event_line
    from plugins.train_trigger import JobStorage

    log = _Lines()
    status_uri = str(tmp_path / "status.json")
    _write(tmp_path, state=RUNNING, global_step=3, epoch=0)
    epoch = EpochDone(epoch=0, global_step=38, epochs=3, eta_s=20.0,
                      record={"train_loss": 0.5, "val_accuracy": 0.8, "samples_per_s_total": 1000.0})
    _ship(status_uri, "1-a", "[worker-0@h] started", "[worker-0@h] INFO events: " + event_line(epoch),
          "[worker-0@h] INFO events: " + event_line(Progress(epoch=1, step=1, steps=38, global_step=39)))
    first, store = _trigger(tmp_path, relay_try=2), JobStorage("aws_default")
    assert first.step(first.read(store), log) is None
    _ship(status_uri, "1-a", "[worker-0@h] after the restart")
    # The triggerer restarts: a trigger built again from the same kwargs.
    path, kwargs = first.serialize()
    again = _trigger(tmp_path, relay_try=kwargs["relay_try"])
    _write(tmp_path, state=SUCCEEDED, global_step=114, epoch=2)
    assert again.step(again.read(store), log).payload["state"] == SUCCEEDED
    relayed = [line.split("launcher: ", 1)[-1] for line in log.lines]
    assert relayed == ["[worker-0@h] started",
                       "[worker-0@h] INFO events: epoch 1/3 done at global step 38, loss 0.5000, "
                       "val_accuracy 0.8000, 1000 samples/s, ETA 0m20s",
                       "job 1-a running: epoch 0, global step 3",
                       "[worker-0@h] after the restart"]
    # Another try of the task starts its own log from the job's first line.
    other = _trigger(tmp_path, relay_try=3)
    assert len(other.read(store)[1]) == 3


def test_a_poll_resolves_the_s3_connection_once_per_trigger_run(tmp_path, monkeypatch):
    """Resolving the connection is what logs "AWS Connection ... credentials retrieved": once per
    run, not once per poll."""
    import io

    from botocore.exceptions import ClientError

    from plugins import train_trigger

    built = []

    class FakeS3:
        def get_object(self, Bucket, Key):
            if Key.endswith("status.json"):
                record = JobStatus(job_id="1-a", state=SUCCEEDED if len(reads) > 4 else RUNNING,
                                   heartbeat=time.time())
                reads.append(Key)
                return {"Body": io.BytesIO(record.to_json())}
            raise ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject")

        def put_object(self, **kw):
            raise AssertionError("nothing to relay, nothing to write")

    reads: list[str] = []
    monkeypatch.setattr(train_trigger.JobStorage, "_build", lambda self: built.append(1) or FakeS3())
    job = {"job_id": "1-a", "status_uri": "s3://b/run/config/status.json", "submitted_at": time.time()}
    t = train_trigger.TrainJobTrigger(job=job, cluster={}, aws_conn_id="aws_default", poll_s=0.01,
                                      stale_after_s=60, stop_grace_s=5)

    async def first_event():
        return await asyncio.wait_for(t.run().__anext__(), 30)

    assert asyncio.run(first_event()).payload["state"] == SUCCEEDED
    assert len(reads) > 4 and len(built) == 1
