"""The training operator under Airflow's real scheduler and triggerer (``airflow_stack``), with
SeaweedFS and MLflow from the session fixtures and the roles on the local backend. Every step is
slowed (``MXPIPE_FAULT_STEP_DELAY_S``) so the job is mid-training when the test acts.

- Durability: while the job trains, the train task is ``deferred``; ``kill -9`` of the scheduler
  and the triggerer (their whole sessions: executor workers included) and a restart: the
  supervisor and its roles keep running, the restarted triggerer polls the same job id, the
  task is not retried, no global step is trained twice nor skipped (the per-step metric
  records), and the run succeeds.
- Mark failed mid-training: the trigger's ``on_kill`` and the teardown stop the job in order,
  the emergency checkpoint is committed, the record ends ``stopped``, no process is left, and
  the task is not retried.
- The task's ``execution_timeout`` (``MXPIPE_TRAIN_TIMEOUT_S``, a stack of its own): the same
  orderly stop, and the task fails without a retry.
The restart test runs last: the components it restarts are stopped when it ends. Every wait is
bounded.
"""
from __future__ import annotations

import os
import sys
import time

import pytest

from common import storage
from common.paths import RunPaths
from infra.airflow_client import AirflowClient, trigger_dag_run, wait_for_dag_run, wait_for_task_state
from training.launch.status import read_status

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from airflow_stack import airflow_stack, killed_and_restarted, stack_client_env  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

DAG_ID = "mxnet_training"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXTRA_ENV = {"MXPIPE_FAULT_STEP_DELAY_S": "0.4"}
# The orderly stop: preempt_grace_s (30 s) for rank 0, the other roles' grace, the last write.
STOP_BOUND_S = 30 + 1 + 5 + 20
TRAIN_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def digits_uri(s3_server, digits_csv):
    uri = f"s3://{s3_server.bucket}/datasets/digits-operator.csv"
    storage.put_bytes(uri, digits_csv)
    return uri


@pytest.fixture(scope="module")
def stack(s3_server, mlflow_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("operator-stack")
    with airflow_stack(home, s3_server, mlflow_server, {DAG_ID: "mxnet_training.py"}, extra_env=EXTRA_ENV) as cfg:
        yield cfg, home, stack_client_env(home, s3_server, mlflow_server, EXTRA_ENV)


@pytest.fixture
def timeout_stack(s3_server, mlflow_server, tmp_path):
    env = {**EXTRA_ENV, "MXPIPE_TRAIN_TIMEOUT_S": str(TRAIN_TIMEOUT_S)}
    with airflow_stack(tmp_path / "home", s3_server, mlflow_server, {DAG_ID: "mxnet_training.py"},
                       extra_env=env) as cfg:
        yield cfg, tmp_path / "home"


def _conf(uri, **kw):
    return {"dataset_uri": uri, "label_column": "label", "recipe": "debug", "model": "mlp", "epochs": 4,
            "batch_size": 32, "learning_rate": 0.005, "optimizer": "adam", "num_workers": 2, "num_servers": 1,
            "kvstore": "dist_sync", "checkpoint_every_n_steps": 10,
            "registered_model_name": "digits-operator", **kw}


def _status_uri(s3_server, run_id):
    return RunPaths(root=s3_server.env["MXPIPE_ARTIFACT_ROOT"], dag_id=DAG_ID, run_id=run_id).job_status


def _wait_training(s3_server, cfg, run_id, min_step, timeout_s=600):
    """The job running past ``min_step`` with the train task deferred; its status record."""
    wait_for_task_state(cfg.airflow_url, DAG_ID, run_id, "train", "deferred", timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = read_status(_status_uri(s3_server, run_id))
        if status is not None and status.state == "running" and status.global_step >= min_step:
            with AirflowClient(cfg.airflow_url) as client:
                assert client.task_states(DAG_ID, run_id)["train"] == "deferred"
            return status
        time.sleep(1)
    raise TimeoutError(f"the job of {run_id} did not pass step {min_step} within {timeout_s}s")


def _train_ti(cfg, run_id):
    with AirflowClient(cfg.airflow_url) as client:
        return next(t for t in client.task_instances(DAG_ID, run_id) if t["task_id"] == "train")


def _role_processes(run_id):
    """This run's role and supervisor processes (each carries its cluster's id)."""
    from common.procs import tagged_processes
    from infra.cluster import cluster_id_for

    return tagged_processes("MXPIPE_CLUSTER", cluster_id_for(f"{DAG_ID}--{run_id}"))


def _check_stopped_in_order(s3_server, home, run_id, seen, started):
    """The job ended ``stopped`` within the bound, its emergency checkpoint committed at or after
    the step seen before the stop, no process of the run left, the train task failed once."""
    from training.checkpoint.store import CheckpointStore

    deadline = started + STOP_BOUND_S + 60
    while time.monotonic() < deadline:
        status = read_status(_status_uri(s3_server, run_id))
        if status.state != "running":
            break
        time.sleep(1)
    assert status.state == "stopped", status
    paths = RunPaths(root=s3_server.env["MXPIPE_ARTIFACT_ROOT"], dag_id=DAG_ID, run_id=run_id)
    newest = CheckpointStore(paths.checkpoints).committed_steps()[0]
    assert newest >= seen.global_step
    logs = "".join(open(os.path.join(root, f)).read() for root, _, files in os.walk(home / "jobs")
                   for f in files if f == f"{status.job_id}.log")
    assert f"emergency checkpoint at step {newest} committed" in logs, logs[-3000:]
    wait_until = time.monotonic() + 120
    while _role_processes(run_id) and time.monotonic() < wait_until:
        time.sleep(1)
    assert not _role_processes(run_id)
    assert not _alive(status.pid)
    return status


def _alive(pid):
    """Running, not merely a zombie: the detached supervisor's parent is whichever process
    adopted it (an Airflow process acting as subreaper), which reaps it when it pleases."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_execution_timeout_stops_the_job_in_order_without_a_retry(timeout_stack, s3_server, digits_uri):
    cfg, home = timeout_stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, _conf(digits_uri, epochs=40))
    seen = _wait_training(s3_server, cfg, run_id, min_step=5)
    assert wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=TRAIN_TIMEOUT_S + 600) == "failed"
    status = _check_stopped_in_order(s3_server, home, run_id, seen, time.monotonic())
    assert status.heartbeat - status.started_at < TRAIN_TIMEOUT_S + STOP_BOUND_S + 30
    ti = _train_ti(cfg, run_id)
    assert ti["state"] == "failed" and ti["try_number"] == 1


def test_mark_failed_mid_training_stops_the_job_in_order(stack, s3_server, digits_uri):
    cfg, home, _ = stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, _conf(digits_uri, epochs=8))
    seen = _wait_training(s3_server, cfg, run_id, min_step=15)
    started = time.monotonic()
    with AirflowClient(cfg.airflow_url) as client:
        client.request("PATCH", f"/dags/{DAG_ID}/dagRuns/{run_id}", json={"state": "failed"})
    _check_stopped_in_order(s3_server, home, run_id, seen, started)
    assert time.monotonic() - started < STOP_BOUND_S + 15
    ti = _train_ti(cfg, run_id)
    assert ti["state"] == "failed" and ti["try_number"] == 1


def test_scheduler_and_triggerer_restart_mid_training_loses_no_step(stack, s3_server, digits_uri):
    cfg, home, client_env = stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, _conf(digits_uri))
    before = _wait_training(s3_server, cfg, run_id, min_step=10)
    supervisor_pid = before.pid
    with killed_and_restarted(cfg, client_env, ["scheduler", "triggerer"]):
        status = read_status(_status_uri(s3_server, run_id))
        assert status.job_id == before.job_id and status.state == "running", status  # nobody watched; it ran on
        assert _alive(supervisor_pid)
        final = wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=900)
        assert final == "success", final
    status = read_status(_status_uri(s3_server, run_id))
    assert status.state == "succeeded" and status.job_id == before.job_id  # the same job, polled again
    assert _train_ti(cfg, run_id)["try_number"] == 1
    import json

    paths = RunPaths(root=s3_server.env["MXPIPE_ARTIFACT_ROOT"], dag_id=DAG_ID, run_id=run_id)
    metrics = json.loads(storage.get_bytes(storage.join(paths.metrics, "train.json")))
    steps = [r["step"] for r in metrics["step_history"]]
    assert steps == list(range(1, metrics["global_step"] + 1)), steps  # no step twice, none skipped
