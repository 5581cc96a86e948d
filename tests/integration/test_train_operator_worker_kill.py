"""``kill -9`` of the train task's own Airflow processes mid-training, under the real scheduler.

The operator runs in its synchronous mode (``MXPIPE_TRAIN_DEFERRABLE=0``): the task process
polls the job itself, so there is a live task process to kill while the job trains (a deferred
task has none). The test kills the LocalExecutor worker running the task and the task runner
it forked, both with SIGKILL, as an OOM kill or a lost node would: nothing runs ``on_kill``.
Then: the supervisor and its roles keep training, the scheduler fails the task on its missed
heartbeats (``task_instance_heartbeat_timeout``, 30 s here) and retries it, and the retry
finds the job id in ``task_state_store`` and reconnects to it (the mixin's reconnect): no
second job on the checkpoint prefix, no global step trained twice nor skipped (the per-step
records), the DAG run succeeds, and the final parameters equal an uninterrupted run's.
"""
from __future__ import annotations

import os
import signal
import sys

import pytest

from infra.airflow_client import trigger_dag_run, wait_for_dag_run
from training.launch.status import read_status

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from operator_runs import (DAG_ID, SYNC_ENV, alive, assert_same_params, conf, digits_uri,  # noqa: E402
                           final_params, operator_stack, status_uri, task_processes, train_ti, trained_steps,
                           wait_training)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def sync_stack(s3_server, mlflow_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("operator-sync-stack")
    with operator_stack(home, s3_server, mlflow_server, **SYNC_ENV) as cfg:
        yield cfg, home


def test_kill_9_of_the_task_process_reconnects_to_the_same_job(sync_stack, s3_server, digits_uri):
    cfg, home = sync_stack
    ref_run = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(digits_uri))
    assert wait_for_dag_run(cfg.airflow_url, DAG_ID, ref_run, timeout_s=900) == "success"
    reference = final_params(s3_server, ref_run)

    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(digits_uri))
    before = wait_training(s3_server, cfg, run_id, min_step=10, task_state="running")
    killed = task_processes(train_ti(cfg, run_id)["id"])
    for proc in killed:
        proc.send_signal(signal.SIGKILL)
    status = read_status(status_uri(s3_server, run_id))
    assert status.job_id == before.job_id and status.state == "running", status  # the job trains on
    assert alive(before.pid)

    assert wait_for_dag_run(cfg.airflow_url, DAG_ID, run_id, timeout_s=900) == "success"
    status = read_status(status_uri(s3_server, run_id))
    assert status.state == "succeeded" and status.job_id == before.job_id  # reconnected, not resubmitted
    assert train_ti(cfg, run_id)["try_number"] == 2
    from infra.cluster import cluster_id_for

    jobs = sorted(f for f in os.listdir(home / "jobs" / cluster_id_for(f"{DAG_ID}--{run_id}")) if f.endswith(".log"))
    assert jobs == [f"{before.job_id}.log"], jobs  # one job on this run's checkpoint prefix, ever
    steps, last = trained_steps(s3_server, run_id)
    assert steps == list(range(1, last + 1)), steps  # no step twice, none skipped
    assert_same_params(final_params(s3_server, run_id), reference)
