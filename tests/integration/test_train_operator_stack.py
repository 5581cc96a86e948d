"""The training operator under Airflow's real scheduler and triggerer (``airflow_stack``), with
SeaweedFS and MLflow from the session fixtures and the roles on the local backend. Every step is
slowed (``MXPIPE_FAULT_STEP_DELAY_S``) so the job is mid-training when the test acts.

- Durability: while the job trains, the train task is ``deferred``; ``kill -9`` of the scheduler
  and the triggerer (their whole sessions: executor workers included) and a restart: the
  supervisor and its roles keep running, the restarted triggerer polls the same job id, the
  task is not retried, no global step is trained twice nor skipped (the per-step metric
  records), the run succeeds, and its final parameters are an uninterrupted run's.
- Mark failed mid-training: the trigger's ``on_kill`` and the teardown stop the job in order,
  the emergency checkpoint is committed, the record ends ``stopped``, no process is left, and
  the task is not retried.
- The task's ``execution_timeout`` (``MXPIPE_TRAIN_TIMEOUT_S``, a stack of its own): the same
  orderly stop, and the task fails without a retry.
- The run's ``dagrun_timeout`` (``MXPIPE_DAGRUN_TIMEOUT_S``, a stack of its own): the scheduler
  fails the run and skips its unfinished tasks, so the triggerer cancels the train task's
  trigger, whose ``on_kill`` stops the job: the same orderly stop within the bound.
The restart test runs last: the components it restarts are stopped when it ends. Every wait is
bounded. ``test_train_operator_worker_kill.py`` kills the task's own process.
"""
from __future__ import annotations

import os
import sys
import time

import pytest

from infra.airflow_client import AirflowClient, trigger_dag_run, wait_for_dag_run
from training.launch.status import read_status

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from airflow_stack import killed_and_restarted, stack_client_env  # noqa: E402
from operator_runs import (DAG_ID, EXTRA_ENV, STOP_BOUND_S, alive, assert_same_params,  # noqa: E402
                           check_stopped_in_order, conf, digits_uri, final_params, mark_failed_and_wait_stopped,
                           operator_stack, status_uri, train_ti, trained_steps, wait_training)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

TRAIN_TIMEOUT_S = 90
# From the run's start: shard, validate and provision come first (a minute or two here).
DAGRUN_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def stack(s3_server, mlflow_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("operator-stack")
    with operator_stack(home, s3_server, mlflow_server) as cfg:
        yield cfg, home, stack_client_env(home, s3_server, mlflow_server, EXTRA_ENV)


@pytest.fixture
def timeout_stack(s3_server, mlflow_server, tmp_path):
    with operator_stack(tmp_path / "home", s3_server, mlflow_server,
                        MXPIPE_TRAIN_TIMEOUT_S=str(TRAIN_TIMEOUT_S)) as cfg:
        yield cfg, tmp_path / "home"


@pytest.fixture
def dagrun_timeout_stack(s3_server, mlflow_server, tmp_path):
    with operator_stack(tmp_path / "home", s3_server, mlflow_server,
                        MXPIPE_DAGRUN_TIMEOUT_S=str(DAGRUN_TIMEOUT_S)) as cfg:
        yield cfg, tmp_path / "home"


@pytest.fixture(scope="module")
def reference(stack, s3_server, digits_uri):
    """The final checkpoint of an uninterrupted run of ``conf``."""
    cfg, _, _ = stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(digits_uri))
    assert wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=900) == "success"
    return final_params(s3_server, run_id)


def test_execution_timeout_stops_the_job_in_order_without_a_retry(timeout_stack, s3_server, digits_uri):
    cfg, home = timeout_stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(digits_uri, epochs=40))
    seen = wait_training(s3_server, cfg, run_id, min_step=5)
    assert wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=TRAIN_TIMEOUT_S + 600) == "failed"
    status = check_stopped_in_order(s3_server, home, run_id, seen, time.monotonic())
    assert status.heartbeat - status.started_at < TRAIN_TIMEOUT_S + STOP_BOUND_S + 30
    ti = train_ti(cfg, run_id)
    assert ti["state"] == "failed" and ti["try_number"] == 1


def test_dagrun_timeout_stops_the_job_in_order(dagrun_timeout_stack, s3_server, digits_uri):
    from datetime import datetime

    cfg, home = dagrun_timeout_stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(digits_uri, epochs=40))
    seen = wait_training(s3_server, cfg, run_id, min_step=5, timeout_s=DAGRUN_TIMEOUT_S)
    assert wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=DAGRUN_TIMEOUT_S + 600) == "failed"
    status = check_stopped_in_order(s3_server, home, run_id, seen, time.monotonic())
    with AirflowClient(cfg.airflow_url) as client:
        run = client.dag_run(DAG_ID, run_id)
    run_started = datetime.fromisoformat(run["start_date"]).timestamp()
    # Stopped within the bound after the run's limit (plus the scheduler's and triggerer's loops).
    assert status.heartbeat - run_started < DAGRUN_TIMEOUT_S + STOP_BOUND_S + 30, status.heartbeat - run_started
    ti = train_ti(cfg, run_id)
    assert ti["state"] == "skipped" and ti["try_number"] == 1, ti


def test_mark_failed_mid_training_stops_the_job_in_order(stack, s3_server, digits_uri):
    cfg, home, _ = stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(digits_uri, epochs=8))
    seen = wait_training(s3_server, cfg, run_id, min_step=15)
    assert mark_failed_and_wait_stopped(s3_server, cfg, home, run_id, seen) < STOP_BOUND_S + 15
    ti = train_ti(cfg, run_id)
    assert ti["state"] == "failed" and ti["try_number"] == 1


def test_scheduler_and_triggerer_restart_mid_training_loses_no_step(stack, s3_server, digits_uri, reference):
    cfg, home, client_env = stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(digits_uri))
    before = wait_training(s3_server, cfg, run_id, min_step=10)
    supervisor_pid = before.pid
    with killed_and_restarted(cfg, client_env, ["scheduler", "triggerer"]):
        status = read_status(status_uri(s3_server, run_id))
        assert status.job_id == before.job_id and status.state == "running", status  # nobody watched; it ran on
        assert alive(supervisor_pid)
        final = wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=900)
        assert final == "success", final
    status = read_status(status_uri(s3_server, run_id))
    assert status.state == "succeeded" and status.job_id == before.job_id  # the same job, polled again
    assert train_ti(cfg, run_id)["try_number"] == 1
    steps, last = trained_steps(s3_server, run_id)
    assert steps == list(range(1, last + 1)), steps  # no step twice, none skipped
    assert_same_params(final_params(s3_server, run_id), reference)
