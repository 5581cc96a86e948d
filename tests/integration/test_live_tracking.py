"""Live MLflow tracking of real local ps-lite jobs against a real MLflow server: epoch metrics
arrive while the job trains, role system metrics and cost are logged, and the run ends FINISHED,
FAILED (a role killed) or KILLED (the supervisor stopped). The live run is the detached
supervisor's own, built from the job document's ``tracking`` section as in a DAG run."""
import _thread
import dataclasses
import logging
import os
import signal
import threading
import time

import pytest

from common import storage
from training.launch.launcher import JobFailed
from testkit.local_jobs import make_job, run_job, shard_digits

pytestmark = pytest.mark.integration

EXPERIMENT = "live-tracking-test"
ROLES = ("scheduler", "server-0", "worker-0", "worker-1")
# Every step of worker 1 is this much longer, so a 4-epoch job trains for well over a sync interval.
SLOW = {"MXPIPE_FAULT_STEP_DELAY_S": "0.15", "MXPIPE_FAULT_KILL_RANK": "1"}
WAIT_S = 240.0


@pytest.fixture(scope="module")
def digits_shards(s3_server, digits_csv):
    return shard_digits(f"s3://{s3_server.bucket}/test-live", digits_csv)


def _tracked(job, mlflow_server, run_id):
    """``job`` with the live run of DAG run ``run_id`` (the section the training task writes)."""
    return dataclasses.replace(job, tracking={
        "tracking_uri": mlflow_server.tracking_uri, "experiment": EXPERIMENT, "run_name": f"dag/{run_id}",
        "find_tags": {"airflow.dag_id": "dag", "airflow.run_id": run_id}, "sync_s": 0.5})


def _client(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.tracking_uri)


def _run_ids(client, run_id):
    """The MLflow runs of DAG run ``run_id``, as the supervisor's live run finds them (its tags)."""
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], f"tags.`airflow.run_id` = '{run_id}'")
    return [r.info.run_id for r in runs]


def _wait_for_epoch_metric(client, run_id, job_thread=None):
    """The id of DAG run ``run_id``'s MLflow run once it has an epoch metric."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for mlflow_run in _run_ids(client, run_id):
            if client.get_metric_history(mlflow_run, "train_loss"):
                return mlflow_run
        if job_thread is not None and not job_thread.is_alive():
            break
        time.sleep(0.2)
    pytest.fail("no epoch metric reached MLflow while the job ran")


def test_epoch_and_system_metrics_arrive_while_the_job_trains(digits_shards, s3_prefix, tmp_path, mlflow_server,
                                                              nothing_left, caplog):
    cfg, shards = digits_shards
    job = _tracked(make_job(cfg, shards, s3_prefix, optim={"epochs": 4}), mlflow_server, "live-ok")
    caplog.set_level(logging.INFO, logger="training.launch.launcher")  # the supervisor's relayed log
    errors = []

    def train():
        try:
            run_job(job, s3_prefix, tmp_path, env=SLOW)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    started = time.monotonic()
    job_thread = threading.Thread(target=train)
    job_thread.start()
    client = _client(mlflow_server)
    run_id = _wait_for_epoch_metric(client, "live-ok", job_thread)
    # The job is still training: rank 0 writes its metrics file only at the end.
    assert job_thread.is_alive() and not storage.exists(job.metrics_uri)
    job_thread.join(WAIT_S)
    wall = time.monotonic() - started
    assert not job_thread.is_alive() and not errors, errors

    assert _run_ids(client, "live-ok") == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [0, 1, 2, 3]
    assert "val_accuracy" in run.data.metrics
    for role in ROLES:
        assert run.data.metrics[f"system/{role}/rss_megabytes"] > 0
        assert f"system/{role}/cpu_percent" in run.data.metrics
        assert 0 < run.data.metrics[f"cost.core_seconds.{role}"] <= wall * os.cpu_count()
    assert run.data.metrics["cost.core_seconds"] <= wall * os.cpu_count()
    assert run.data.metrics["cost.recompute_share"] == 0.0
    assert "cost.gpu_seconds" not in run.data.metrics and "cost.usd" not in run.data.metrics
    assert "MLflow live tracking could not" not in caplog.text  # no tracking call failed


def test_a_restart_in_place_is_counted_in_the_live_run(digits_shards, s3_prefix, tmp_path, mlflow_server,
                                                       nothing_left):
    cfg, shards = digits_shards
    job = _tracked(make_job(cfg, shards, s3_prefix, optim={"epochs": 3}, checkpoint={"every_n_steps": 7}),
                   mlflow_server, "live-restarted")
    fault = {"MXPIPE_FAULT_KILL_STEP": "30", "MXPIPE_FAULT_KILL_RANK": "1",
             "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")}
    run_job(job, s3_prefix, tmp_path, env=fault)  # one supervisor: the roles restart in place
    client = _client(mlflow_server)
    [run_id] = _run_ids(client, "live-restarted")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and (tmp_path / "fault-fired").exists()
    assert run.data.metrics["job.restarts"] == 1 and run.data.metrics["job.restarts_without_progress"] == 0
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [0, 1, 2]  # no epoch twice


def test_a_killed_role_ends_the_run_failed_and_the_retry_reuses_it(digits_shards, s3_prefix, tmp_path,
                                                                   mlflow_server, nothing_left):
    cfg, shards = digits_shards
    job = _tracked(make_job(cfg, shards, s3_prefix, optim={"epochs": 3}, checkpoint={"every_n_steps": 7},
                            cluster={"max_restarts_without_progress": 0}),  # the retry is a new supervisor
                   mlflow_server, "live-killed")
    fault = {"MXPIPE_FAULT_KILL_STEP": "30", "MXPIPE_FAULT_KILL_RANK": "1",
             "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")}
    with pytest.raises(JobFailed):
        run_job(job, s3_prefix, tmp_path, env=fault)
    client = _client(mlflow_server)
    [run_id] = _run_ids(client, "live-killed")
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert "SIGKILL" in run.data.tags["error"]
    assert client.get_metric_history(run_id, "train_loss")  # the epoch before the kill
    first_core_s = run.data.metrics["cost.core_seconds"]

    run_job(job, s3_prefix, tmp_path, env=fault)  # the retry: a new supervisor, the same run
    assert _run_ids(client, "live-killed") == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [0, 1, 2]
    assert run.data.metrics["cost.core_seconds"] > first_core_s  # both attempts counted


def test_stopping_the_supervisor_ends_the_run_killed(digits_shards, s3_prefix, tmp_path, mlflow_server,
                                                     nothing_left):
    cfg, shards = digits_shards
    # Far longer than the wait for the first epoch's metric, however loaded the machine (early
    # stopping off): the job is stopped long before it could end.
    job = _tracked(make_job(cfg, shards, s3_prefix, optim={"epochs": 500, "early_stopping_patience": 0}),
                   mlflow_server, "live-stopped")
    client = _client(mlflow_server)

    stopper_failed: list[BaseException] = []

    def stop_after_first_epoch():
        try:
            _wait_for_epoch_metric(client, "live-stopped")
        except BaseException as exc:  # noqa: BLE001 - reported below, once the job is stopped
            stopper_failed.append(exc)
        finally:
            # Ctrl-C while waiting: the job is stopped (SIGTERM to its supervisor). Also when the
            # wait failed: else the test would wait on a 500-epoch job.
            _thread.interrupt_main()

    # interrupt_main() acts through the SIGINT handler, which an earlier test of this worker
    # process may have replaced with one that does not raise (the test hung to its timeout so).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    stopper = threading.Thread(target=stop_after_first_epoch, daemon=True)
    stopper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_job(job, s3_prefix, tmp_path, env=SLOW)
    finally:
        signal.signal(signal.SIGINT, handler)
    stopper.join(5)
    assert not stopper_failed, stopper_failed
    [run_id] = _run_ids(client, "live-stopped")
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.data.tags["error"] == "the job was stopped on request"
    assert run.data.metrics["progress.global_step"] > 0
