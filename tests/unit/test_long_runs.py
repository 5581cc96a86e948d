"""A training longer than one hour is possible from the DAG, without a real hour: the form's
``job_timeout_s`` reaches the job document the supervisor loads, and a supervisor given 72 h
lets a job run past two hours of its clock (scaled here: one real second is one hour) and
finish, where one given the former default of 3600 s ends it. The task's side (the
``execution_timeout`` from ``MXPIPE_TRAIN_TIMEOUT_S`` reaching the deferral) is in
test_train_operator.py and tests/dag/test_dag_file.py."""
import os
import time
import types

import pytest

from tests.unit import script_cluster
from training.launch import launcher
from training.launch.job import JobSpec
from training.launch.launcher import JobFailed, Supervisor

pytestmark = pytest.mark.unit

THREE_DAYS_S = 259200
HOUR_PER_SECOND = 3600.0


@pytest.fixture
def hours_clock(monkeypatch):
    """The supervisor's monotonic clock, one hour per real second from now."""
    real, t0 = time.monotonic, time.monotonic()
    monkeypatch.setattr(launcher, "time", types.SimpleNamespace(
        monotonic=lambda: t0 + (real() - t0) * HOUR_PER_SECOND, time=time.time, sleep=time.sleep))


def _job_from_the_form(tmp_path, job_timeout_s):
    """The job document the train task writes for a run triggered with ``job_timeout_s``."""
    pytest.importorskip("airflow.sdk")
    from plugins.run_config import resolve
    from tests.unit.test_run_config import trigger
    from plugins.params import training_params

    cfg = resolve(trigger(training_params(), job_timeout_s=job_timeout_s))
    # Hours of the scaled clock between a worker's lines are no stall here.
    cfg = cfg.replace(cluster={"num_workers": 2, "num_servers": 1, "stall_timeout_s": 4 * 3600.0,
                               "start_timeout_s": 4 * 3600.0, "job_timeout_s": cfg.cluster.job_timeout_s})
    job = JobSpec(config=cfg, shards_prefix="s", checkpoint_prefix="c", model_prefix="m", metrics_uri="x")
    uri = tmp_path / "job.json"
    uri.write_text(job.to_json())
    return JobSpec.from_json(uri.read_text())


def _cluster(watch):
    # About 2.5 real seconds of steps: 2.5 hours on the supervisor's clock.
    worker = "for i in $(seq 25); do echo \"progress global_step=$i\"; sleep 0.1; done"
    cluster = script_cluster.ScriptCluster(watch.record_dirs[0], watch.env, {
        "worker-0": worker, "worker-1": worker, "scheduler": "sleep 1", "server-0": "sleep 1"})
    cluster.watch = watch
    return cluster


def test_a_three_day_limit_from_the_form_lets_a_job_train_past_two_hours(tmp_path, nothing_left, hours_clock):
    job = _job_from_the_form(tmp_path, THREE_DAYS_S)
    assert job.config.cluster.job_timeout_s == THREE_DAYS_S
    started = launcher.time.monotonic()
    Supervisor(job.config, cluster=_cluster(nothing_left), base_env=dict(os.environ)).run("job.json")
    took = launcher.time.monotonic() - started
    assert took > 2 * 3600, took


def test_the_former_one_hour_default_would_have_ended_it(tmp_path, nothing_left, hours_clock):
    job = _job_from_the_form(tmp_path, 3600)
    with pytest.raises(JobFailed, match="exceeded its timeout of 3600s"):
        Supervisor(job.config, cluster=_cluster(nothing_left), base_env=dict(os.environ)).run("job.json")
