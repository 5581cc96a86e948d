"""Restart in place with real ps-lite jobs (2 workers, 1 server, ``dist_sync``, the optimizer on
the workers so resume is exact) on the local backend under a detached supervisor: a job that
loses a worker three times (more than the train task's two Airflow retries) restarts its roles
each time and ends with the parameters of an uninterrupted run, bit for bit; a job that loses a
worker at the same step every round, with no checkpoint in between, stops after its budget with
an error that says so, and is not retried."""
import io

import numpy as np
import pytest

from common import storage
from testkit.local_jobs import make_job, run_job, shard_digits
from training.checkpoint.store import store_for
from training.launch.launcher import JobFailed
from training.launch.status import read_status

pytestmark = pytest.mark.integration

KILLS = [15, 35, 55]  # global steps; checkpoints every 10 steps, so each round commits before its kill


@pytest.fixture(scope="module")
def digits(tmp_path_factory, digits_csv):
    cfg, shards = shard_digits(str(tmp_path_factory.mktemp("digits")), digits_csv)
    cfg = cfg.replace(optim={"epochs": 4}, checkpoint={"every_n_steps": 10},
                      cluster={"num_workers": 2, "num_servers": 1, "kvstore": "dist_sync", "optimizer_on": "workers",
                               "job_timeout_s": 600})
    return cfg, shards


def _final(job):
    store = store_for(job.checkpoint_prefix, job.config.checkpoint)
    step = store.committed_steps()[0]
    ckpt = store.load(step)
    with np.load(io.BytesIO(ckpt.files["params.npz"])) as arrays:
        return step, {k: arrays[k].copy() for k in arrays.files}


def test_a_job_that_loses_a_worker_three_times_restarts_in_place_and_ends_bit_identical(digits, tmp_path):
    cfg, shards = digits
    reference = make_job(cfg, shards, str(tmp_path / "reference"))
    run_job(reference, str(tmp_path / "reference"), tmp_path)

    prefix = str(tmp_path / "killed")
    job = make_job(cfg, shards, prefix)
    faults = {"MXPIPE_FAULT_KILL_STEPS": ",".join(map(str, KILLS)), "MXPIPE_FAULT_KILL_RANK": "1",
              "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fired")}
    roles = run_job(job, prefix, tmp_path, faults)
    assert all((tmp_path / f"fired-{step}").exists() for step in KILLS), "a kill never fired"
    status = read_status(storage.join(prefix, "job_status.json"))
    assert status.state == "succeeded" and status.restarts == 3 and status.restarts_without_progress == 0
    assert "failed: killed by SIGKILL" in status.last_restart_reason
    assert roles.count("worker-1") == 4  # one supervisor, four rounds of roles

    step, params = _final(job)
    ref_step, ref_params = _final(reference)
    assert step == ref_step and params.keys() == ref_params.keys()
    assert all(np.array_equal(params[k], ref_params[k]) for k in params), "not bit-identical to the reference"


def test_a_job_that_loses_a_worker_at_the_same_step_every_round_stops_after_its_budget(digits, tmp_path):
    cfg, shards = digits
    prefix = str(tmp_path / "stuck")
    job = make_job(cfg, shards, prefix, cluster={"max_restarts_without_progress": 2})
    # No once-file: every round resumes from step 10 and loses worker 1 at step 15 again.
    with pytest.raises(JobFailed) as failed:
        run_job(job, prefix, tmp_path, {"MXPIPE_FAULT_KILL_STEP": "15", "MXPIPE_FAULT_KILL_RANK": "1"})
    err = failed.value
    assert err.deterministic  # the operator fails the task without a retry
    assert str(err).startswith("gave up after 2 in-place restart(s) in a row without progress (no checkpoint "
                               "committed after step 10; cluster.max_restarts_without_progress=2; 3 restart(s)")
    assert "failed: killed by SIGKILL" in str(err)
    status = read_status(storage.join(prefix, "job_status.json"))
    assert status.state == "failed" and status.deterministic and status.restarts == 3
