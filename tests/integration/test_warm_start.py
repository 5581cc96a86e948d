"""Warm start with real multi-process ps-lite jobs: a job named after another run's checkpoints
starts from that run's parameters only while it has no checkpoint of its own.

Storage is a temp folder (the storage module accepts local paths). The second job trains with a
learning rate of 1e-12, so its final parameters equal the source run's exactly when it really
started from them, and differ by orders of magnitude from a fresh Xavier start.
"""
import dataclasses
import io
import logging

import numpy as np
import pytest
from common import storage
from data_checks.shard import shard_dataset
from training.checkpoint.store import store_for
from common.config import recipe
from training.launch.launcher import JobFailed
from testkit.local_jobs import make_job, run_job

pytestmark = pytest.mark.integration

# Synchronous uploads: the step-7 checkpoint is committed before the kill at step 12.
OVERRIDES = {"optim": {"epochs": 1}, "checkpoint": {"every_n_steps": 7, "keep": 2, "async_upload": False}}


def _params(job):
    ckpt = store_for(job.checkpoint_prefix, job.config.checkpoint).latest()
    with np.load(io.BytesIO(ckpt.files["params.npz"])) as arrays:
        return {k: arrays[k].copy() for k in arrays.files}


def _max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def test_warm_start_loads_the_source_run_then_a_retry_resumes_its_own(tmp_path, digits_csv, caplog):
    caplog.set_level(logging.INFO)
    root = str(tmp_path / "store")
    source = storage.join(root, "digits.csv")
    storage.put_bytes(source, digits_csv)
    cfg = recipe("debug", source).replace(**OVERRIDES)
    shards = storage.join(root, "shards")
    shard_dataset(cfg, shards)

    first = make_job(cfg, shards, storage.join(root, "run-a"))
    run_job(first, storage.join(root, "run-a"), tmp_path)
    trained = _params(first)

    # No restart in place: the killed job ends, and the next one (the retry's) resumes its own.
    warm = make_job(cfg, shards, storage.join(root, "run-b"), optim={"learning_rate": 1e-12},
                    cluster={"max_restarts_without_progress": 0})
    warm = dataclasses.replace(warm, warm_start_prefix=first.checkpoint_prefix)
    # Attempt 1 warm-starts, checkpoints at step 7 and is killed at step 12.
    caplog.clear()
    with pytest.raises(JobFailed):
        run_job(warm, storage.join(root, "run-b"), tmp_path,
                env={"MXPIPE_FAULT_KILL_STEP": "12", "MXPIPE_FAULT_KILL_RANK": "1"})
    assert "warm start: parameters from step 20" in caplog.text, caplog.text[-3000:]
    # The retry resumes its own run's checkpoint, not the source run's.
    caplog.clear()
    run_job(warm, storage.join(root, "run-b"), tmp_path)
    assert "resumed from step 7" in caplog.text and "warm start:" not in caplog.text, caplog.text[-3000:]
    assert _max_diff(_params(warm), trained) < 1e-6

    # Control: the same job without warm start lands far from the source run.
    cold = make_job(cfg, shards, storage.join(root, "run-c"), optim={"learning_rate": 1e-12})
    run_job(cold, storage.join(root, "run-c"), tmp_path)
    assert _max_diff(_params(cold), trained) > 1e-2
