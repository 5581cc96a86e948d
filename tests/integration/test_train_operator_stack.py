"""The training operator under Airflow's real scheduler and triggerer (``airflow_stack``), with
SeaweedFS and MLflow from the session fixtures and the roles on the local backend. Every step is
slowed (``MXPIPE_FAULT_STEP_DELAY_S``) so the job is mid-training when the test acts.

One stack runs every test: the limits that differ between them are read when a DAG is parsed, so
the stack parses the shipped DAG and its test variants (``dags_operator_variants.py``: the same
pipeline under other ids with a train timeout, a run timeout, or the synchronous operator). The
runs that only wait (the two uninterrupted references, both timeout runs) are triggered together
when the stack is up and watched in threads (``background``), so they train while the other tests
act; each test asserts on its own run.

- Durability: while the job trains, the train task is ``deferred``; ``kill -9`` of the scheduler
  and the triggerer (their whole sessions: executor workers included) and a restart: the
  supervisor and its roles keep running, the restarted triggerer polls the same job id, the
  task is not retried, no global step is trained twice nor skipped (the per-step metric
  records), the run succeeds, and its final parameters are an uninterrupted run's.
- ``kill -9`` of the train task's own Airflow processes, with the operator in its synchronous
  mode (``deferrable=False``: the task process polls the job itself, so there is a live task
  process to kill; a deferred task has none). The LocalExecutor worker running the task and the
  task runner it forked both get SIGKILL, as an OOM kill or a lost node would: nothing runs
  ``on_kill``. The supervisor and its roles keep training, the scheduler fails the task on its
  missed heartbeats (``task_instance_heartbeat_timeout``, 30 s on this stack: a deferred task
  has no heartbeat to miss) and retries it, and the retry finds the job id in
  ``task_state_store`` and reconnects to it: no second job on the checkpoint prefix, no step
  twice nor skipped, the run succeeds, and the final parameters equal an uninterrupted run's.
- Mark failed mid-training: the trigger's ``on_kill`` and the teardown stop the job in order,
  the emergency checkpoint is committed, the record ends ``stopped``, no process is left, and
  the task is not retried.
- The task's ``execution_timeout`` (``MXPIPE_TRAIN_TIMEOUT_S``'s DAG argument): the same orderly
  stop, and the task fails without a retry.
- The run's ``dagrun_timeout`` (``MXPIPE_DAGRUN_TIMEOUT_S``'s): the scheduler fails the run and
  skips its unfinished tasks, so the triggerer cancels the train task's trigger, whose
  ``on_kill`` stops the job: the same orderly stop within the bound.
The restart test runs last, when every other run has ended (the kill takes every running task of
the stack with the scheduler's session): the components it restarts are stopped when it ends.
Every wait is bounded.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from infra.airflow_client import (TERMINAL_RUN_STATES, AirflowClient, trigger_dag_run, wait_for_dag_run,
                                  wait_for_task_state)
from training.launch.status import read_status
from testkit.airflow_stack import killed_and_restarted, stack_client_env
from testkit.dags_operator_variants import (DAGRUN_TIMEOUT_S, REFERENCE, RUN_TIMEOUT, SYNC, SYNC_REFERENCE,
                                            TRAIN_TIMEOUT, TRAIN_TIMEOUT_S, VARIANTS)
from testkit.operator_runs import (DAG_ID, STOP_BOUND_S, VARIANTS_ENV, alive, assert_same_params,
                                   check_stopped_in_order, conf, digits_uri, final_params,
                                   mark_failed_and_wait_stopped, status_uri, task_processes, train_ti,
                                   trained_steps, variants_stack, wait_training)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

# How long a test waits for a background run's outcome: each background wait is bounded itself.
BACKGROUND_WAIT_S = 1500


@pytest.fixture(scope="module")
def stack(s3_server, mlflow_server, tmp_path_factory):
    home = tmp_path_factory.mktemp("operator-stack")
    with variants_stack(home, s3_server, mlflow_server, VARIANTS) as cfg:
        yield cfg, home, stack_client_env(home, s3_server, mlflow_server, VARIANTS_ENV)


@dataclass
class Watched:
    """A background run: its id, and its outcome as a future (raises what the watch raised)."""
    run_id: str
    outcome: Future[Any]

    def result(self) -> Any:
        return self.outcome.result(timeout=BACKGROUND_WAIT_S)


@dataclass
class Background:
    train_timeout: Watched  # outcome: the job's status seen while it trained
    run_timeout: Watched  # the same
    reference: Watched  # outcome: final_params of an uninterrupted run (deferred operator)
    sync_reference: Watched  # the same, synchronous operator


@pytest.fixture(scope="module", autouse=True)
def background(stack, s3_server, digits_uri) -> Iterator[Background]:
    """The runs that only wait, triggered as the stack is up. The run-timeout run goes first, and
    the others once it has provisioned: its limit counts from the run's start, so its shard and
    validate tasks do not queue behind theirs, and they reuse its shards rather than write the
    same files at once."""
    cfg = stack[0]
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="operator-run")

    def watch(dag_id: str, until: Callable[[str], Any], **conf_kw: Any) -> Watched:
        run_id = trigger_dag_run(cfg.airflow_url, dag_id, conf(digits_uri, **conf_kw))
        return Watched(run_id, pool.submit(until, run_id))

    def training(dag_id: str, timeout_s: float = 600) -> Callable[[str], Any]:
        return lambda run_id: wait_training(s3_server, cfg, run_id, min_step=5, timeout_s=timeout_s, dag_id=dag_id)

    def succeeded(dag_id: str) -> Callable[[str], Any]:
        def final(run_id: str) -> Any:
            assert wait_for_dag_run(cfg.airflow_url, dag_id, run_id, timeout_s=900) == "success"
            return final_params(s3_server, run_id, dag_id)
        return final

    run_timeout = watch(RUN_TIMEOUT, training(RUN_TIMEOUT, timeout_s=DAGRUN_TIMEOUT_S), epochs=40)
    wait_for_task_state(cfg.airflow_url, RUN_TIMEOUT, run_timeout.run_id, "provision", "success",
                        timeout_s=DAGRUN_TIMEOUT_S)
    runs = Background(train_timeout=watch(TRAIN_TIMEOUT, training(TRAIN_TIMEOUT), epochs=40),
                      run_timeout=run_timeout, reference=watch(REFERENCE, succeeded(REFERENCE)),
                      sync_reference=watch(SYNC_REFERENCE, succeeded(SYNC_REFERENCE)))
    yield runs
    # A failed test may leave a watch running: it ends by its own bound, or at once when the
    # stack it polls is stopped.
    pool.shutdown(wait=False, cancel_futures=True)


def test_mark_failed_mid_training_stops_the_job_in_order(stack, s3_server, digits_uri):
    cfg, home, _ = stack
    run_id = trigger_dag_run(cfg.airflow_url, DAG_ID, conf(digits_uri, epochs=8))
    seen = wait_training(s3_server, cfg, run_id, min_step=15)
    assert mark_failed_and_wait_stopped(s3_server, cfg, home, run_id, seen) < STOP_BOUND_S + 15
    ti = train_ti(cfg, run_id)
    assert ti["state"] == "failed" and ti["try_number"] == 1


def test_kill_9_of_the_task_process_reconnects_to_the_same_job(stack, background, s3_server, digits_uri):
    cfg, home, _ = stack
    run_id = trigger_dag_run(cfg.airflow_url, SYNC, conf(digits_uri))
    before = wait_training(s3_server, cfg, run_id, min_step=10, task_state="running", dag_id=SYNC)
    killed = task_processes(train_ti(cfg, run_id, SYNC)["id"])
    for proc in killed:
        proc.send_signal(signal.SIGKILL)
    status = read_status(status_uri(s3_server, run_id, SYNC))
    assert status.job_id == before.job_id and status.state == "running", status  # the job trains on
    assert alive(before.pid)

    assert wait_for_dag_run(cfg.airflow_url, SYNC, run_id, timeout_s=900) == "success"
    status = read_status(status_uri(s3_server, run_id, SYNC))
    assert status.state == "succeeded" and status.job_id == before.job_id  # reconnected, not resubmitted
    assert train_ti(cfg, run_id, SYNC)["try_number"] == 2
    from infra.cluster import cluster_id_for

    jobs = sorted(f for f in os.listdir(home / "jobs" / cluster_id_for(f"{SYNC}--{run_id}")) if f.endswith(".log"))
    assert jobs == [f"{before.job_id}.log"], jobs  # one job on this run's checkpoint prefix, ever
    steps, last = trained_steps(s3_server, run_id, SYNC)
    assert steps == list(range(1, last + 1)), steps  # no step twice, none skipped
    assert_same_params(final_params(s3_server, run_id, SYNC), background.sync_reference.result())


def test_execution_timeout_stops_the_job_in_order_without_a_retry(stack, background, s3_server):
    cfg, home, _ = stack
    run_id, seen = background.train_timeout.run_id, background.train_timeout.result()
    assert wait_for_dag_run(cfg.airflow_url, TRAIN_TIMEOUT, run_id, timeout_s=TRAIN_TIMEOUT_S + 600) == "failed"
    status = check_stopped_in_order(s3_server, home, run_id, seen, time.monotonic(), TRAIN_TIMEOUT)
    assert status.heartbeat - status.started_at < TRAIN_TIMEOUT_S + STOP_BOUND_S + 30
    ti = train_ti(cfg, run_id, TRAIN_TIMEOUT)
    assert ti["state"] == "failed" and ti["try_number"] == 1


def test_dagrun_timeout_stops_the_job_in_order(stack, background, s3_server):
    from datetime import datetime

    cfg, home, _ = stack
    run_id, seen = background.run_timeout.run_id, background.run_timeout.result()
    assert wait_for_dag_run(cfg.airflow_url, RUN_TIMEOUT, run_id, timeout_s=DAGRUN_TIMEOUT_S + 600) == "failed"
    status = check_stopped_in_order(s3_server, home, run_id, seen, time.monotonic(), RUN_TIMEOUT)
    with AirflowClient(cfg.airflow_url) as client:
        run = client.dag_run(RUN_TIMEOUT, run_id)
    run_started = datetime.fromisoformat(run["start_date"]).timestamp()
    # Stopped within the bound after the run's limit (plus the scheduler's and triggerer's loops).
    assert status.heartbeat - run_started < DAGRUN_TIMEOUT_S + STOP_BOUND_S + 30, status.heartbeat - run_started
    ti = train_ti(cfg, run_id, RUN_TIMEOUT)
    assert ti["state"] == "skipped" and ti["try_number"] == 1, ti


def test_scheduler_and_triggerer_restart_mid_training_loses_no_step(stack, background, s3_server, digits_uri):
    cfg, home, client_env = stack
    reference = background.reference.result()
    # The kill below takes every running task of the stack with the scheduler's session: the
    # other runs end first (they have, unless a test before this one failed).
    with AirflowClient(cfg.airflow_url) as client:
        in_flight = [(d, r["dag_run_id"]) for d in (DAG_ID, *VARIANTS) for r in client.dag_runs(d)
                     if r["state"] not in TERMINAL_RUN_STATES]
    for dag_id, other in in_flight:
        wait_for_dag_run(cfg.airflow_url, dag_id, other, timeout_s=900)
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
