"""Live MLflow tracking of real local ps-lite jobs against a real MLflow server: epoch metrics
arrive while the job trains, role system metrics and cost are logged, and the run ends FINISHED,
FAILED (a role killed) or KILLED (the supervisor stopped)."""
import _thread
import os
import sys
import threading
import time

import pytest

from common import storage
from data_checks.shard import shard_dataset
from common.config import recipe
from training.launch.launcher import JobFailed
from training.tracking.live import LiveRun

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from local_jobs import make_job, run_job  # noqa: E402

pytestmark = pytest.mark.integration

EXPERIMENT = "live-tracking-test"
ROLES = ("scheduler", "server-0", "worker-0", "worker-1")
# Every step of worker 1 is this much longer, so a 4-epoch job trains for well over a sync interval.
SLOW = {"MXPIPE_FAULT_STEP_DELAY_S": "0.15", "MXPIPE_FAULT_KILL_RANK": "1"}
WAIT_S = 240.0


@pytest.fixture(scope="module")
def digits_shards(s3_server, digits_csv):
    bucket = f"s3://{s3_server.bucket}/test-live"
    source = storage.join(bucket, "digits.csv")
    storage.put_bytes(source, digits_csv)
    cfg = recipe("debug", source)
    shard_dataset(cfg, storage.join(bucket, "shards"))
    return cfg, storage.join(bucket, "shards")


def _live(mlflow_server, run_id):
    return LiveRun(tracking_uri=mlflow_server.tracking_uri, experiment=EXPERIMENT, run_name=f"dag/{run_id}",
                   find_tags={"airflow.dag_id": "dag", "airflow.run_id": run_id}, sync_s=0.5)


def _client(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.tracking_uri)


def _wait_for_epoch_metric(live, client, job_thread=None):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if live.run_id and client.get_metric_history(live.run_id, "train_loss"):
            return
        if job_thread is not None and not job_thread.is_alive():
            break
        time.sleep(0.2)
    pytest.fail("no epoch metric reached MLflow while the job ran")


def test_epoch_and_system_metrics_arrive_while_the_job_trains(digits_shards, s3_prefix, tmp_path, mlflow_server,
                                                              nothing_left):
    cfg, shards = digits_shards
    job = make_job(cfg, shards, s3_prefix, optim={"epochs": 4})
    live = _live(mlflow_server, "live-ok")
    errors = []

    def train():
        try:
            run_job(job, s3_prefix, tmp_path, env=SLOW, observer=live)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    started = time.monotonic()
    job_thread = threading.Thread(target=train)
    job_thread.start()
    client = _client(mlflow_server)
    _wait_for_epoch_metric(live, client, job_thread)
    # The job is still training: rank 0 writes its metrics file only at the end.
    assert job_thread.is_alive() and not storage.exists(job.metrics_uri)
    job_thread.join(WAIT_S)
    wall = time.monotonic() - started
    assert not job_thread.is_alive() and not errors, errors

    run = client.get_run(live.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(live.run_id, "train_loss")] == [0, 1, 2, 3]
    assert "val_accuracy" in run.data.metrics
    for role in ROLES:
        assert run.data.metrics[f"system/{role}/rss_megabytes"] > 0
        assert f"system/{role}/cpu_percent" in run.data.metrics
        assert 0 < run.data.metrics[f"cost.core_seconds.{role}"] <= wall * os.cpu_count()
    assert run.data.metrics["cost.core_seconds"] <= wall * os.cpu_count()
    assert run.data.metrics["cost.recompute_share"] == 0.0
    assert "cost.gpu_seconds" not in run.data.metrics and "cost.usd" not in run.data.metrics
    assert live.errors == 0


def test_a_killed_role_ends_the_run_failed_and_the_retry_reuses_it(digits_shards, s3_prefix, tmp_path,
                                                                   mlflow_server, nothing_left):
    cfg, shards = digits_shards
    job = make_job(cfg, shards, s3_prefix, optim={"epochs": 3}, checkpoint={"every_n_steps": 7})
    fault = {"MXPIPE_FAULT_KILL_STEP": "30", "MXPIPE_FAULT_KILL_RANK": "1",
             "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")}
    live = _live(mlflow_server, "live-killed")
    with pytest.raises(JobFailed):
        run_job(job, s3_prefix, tmp_path, env=fault, observer=live)
    client = _client(mlflow_server)
    run = client.get_run(live.run_id)
    assert run.info.status == "FAILED"
    assert "SIGKILL" in run.data.tags["error"]
    assert client.get_metric_history(live.run_id, "train_loss")  # the epoch before the kill
    first_core_s = run.data.metrics["cost.core_seconds"]

    retry = _live(mlflow_server, "live-killed")
    run_job(job, s3_prefix, tmp_path, env=fault, observer=retry)
    assert retry.run_id == live.run_id
    run = client.get_run(retry.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(retry.run_id, "train_loss")] == [0, 1, 2]
    assert run.data.metrics["cost.core_seconds"] > first_core_s  # both attempts counted


def test_stopping_the_supervisor_ends_the_run_killed(digits_shards, s3_prefix, tmp_path, mlflow_server,
                                                     nothing_left):
    cfg, shards = digits_shards
    job = make_job(cfg, shards, s3_prefix, optim={"epochs": 20})
    live = _live(mlflow_server, "live-stopped")
    client = _client(mlflow_server)

    def stop_after_first_epoch():
        _wait_for_epoch_metric(live, client)
        _thread.interrupt_main()  # what Ctrl-C (or Airflow's task termination) does to the supervisor

    stopper = threading.Thread(target=stop_after_first_epoch, daemon=True)
    stopper.start()
    with pytest.raises(KeyboardInterrupt):
        run_job(job, s3_prefix, tmp_path, env=SLOW, observer=live)
    stopper.join(5)
    run = client.get_run(live.run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["error"].startswith("stopped: KeyboardInterrupt")
    assert run.data.metrics["progress.global_step"] > 0
