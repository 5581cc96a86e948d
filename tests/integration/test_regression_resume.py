"""A regression job on standardised targets resumes exactly: the targets' train mean and std are
in the manifest (fitted once, at shard time), and every worker standardises the rows it gathers
with them, so a job killed mid-run and resumed ends with the uninterrupted job's parameters.
Real 2-worker ps-lite jobs checkpointing to a real S3 server (SeaweedFS)."""

import numpy as np
import pytest

from common import storage
from training.checkpoint.store import store_for
from training.launch.launcher import JobFailed

from testkit.local_jobs import checkpoint_params, make_job as _job, run_job as _run
from testkit.scaled_tables import TARGET, scaled_regression_table

pytestmark = pytest.mark.integration


def _last_step(job):
    return store_for(job.checkpoint_prefix, job.config.checkpoint).latest().step


def test_a_killed_regression_job_resumes_to_the_same_parameters(s3_server, tmp_path):
    from common.config import recipe
    from data_checks.shard import shard_dataset

    bucket = f"s3://{s3_server.bucket}/test-regression-resume"
    source = storage.join(bucket, "table.csv")
    storage.put_bytes(source, scaled_regression_table(600, seed=4).to_csv(index=False).encode())
    # Dropout: the per-step RNG re-seeding is resumed too. 420 train rows, 7 steps an epoch.
    cfg = recipe("debug", source).replace(data={"label_column": TARGET}, model={"task": "regression", "dropout": 0.2},
                                          optim={"epochs": 4}, checkpoint={"every_n_steps": 5})
    manifest = shard_dataset(cfg, storage.join(bucket, "shards"))
    assert manifest["preprocessing"]["targets"][0]["mean"] > 4000  # trained standardised
    shards = storage.join(bucket, "shards")
    ref = _job(cfg, shards, storage.join(bucket, "reference"))
    _run(ref, storage.join(bucket, "reference"), tmp_path / "ref")
    # No restart in place: the killed job ends, and the next one (the retry's) resumes.
    job = _job(cfg, shards, storage.join(bucket, "resumed"), cluster={"max_restarts_without_progress": 0})
    with pytest.raises(JobFailed):
        _run(job, storage.join(bucket, "resumed"), tmp_path / "a",
             env={"MXPIPE_FAULT_KILL_STEP": "12", "MXPIPE_FAULT_KILL_RANK": "1"})
    _run(job, storage.join(bucket, "resumed"), tmp_path / "b")
    assert _last_step(job) == _last_step(ref) == 28
    params, reference = checkpoint_params(job, 28), checkpoint_params(ref, 28)
    assert sorted(params) == sorted(reference)
    assert all(np.array_equal(params[k], reference[k]) for k in params)  # bit-identical
