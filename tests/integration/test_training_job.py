"""Real multi-process parameter-server jobs (scheduler + servers + workers) on this machine,
reading shards from and checkpointing to a real S3 server (SeaweedFS)."""
import json
import logging
import re

import pytest

from common import storage
from training.checkpoint.store import CheckpointStore
from training.launch.launcher import JobFailed
from testkit.local_jobs import make_job as _job, run_job as _run, shard_digits

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def digits_shards(s3_server, digits_csv):
    return shard_digits(f"s3://{s3_server.bucket}/test-jobs", digits_csv)


def test_dist_sync_two_workers_one_server(digits_shards, s3_prefix, tmp_path):
    cfg, shards = digits_shards
    job = _job(cfg, shards, s3_prefix, optim={"epochs": 4})
    roles = _run(job, s3_prefix, tmp_path)
    assert roles == ["scheduler", "server-0", "worker-0", "worker-1"]
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    assert metrics["num_workers"] == 2
    assert len(metrics["history"]) == 4
    assert metrics["history"][-1]["val_accuracy"] > 0.85
    names = sorted(u.rsplit("/", 1)[1] for u in storage.list_uris(job.model_prefix))
    assert names == ["model-0000.params", "model-symbol.json", "model_meta.json", "preprocessing.json"]
    store = CheckpointStore(job.checkpoint_prefix, keep=cfg.checkpoint.keep)
    assert store.committed_steps()[0] == metrics["global_step"]
    assert len(store.committed_steps()) == cfg.checkpoint.keep


def test_killed_worker_stops_the_job_and_the_retry_resumes(digits_shards, s3_prefix, tmp_path, caplog):
    cfg, shards = digits_shards
    # No restart in place: the job ends, and the next one (the retry's) resumes.
    job = _job(cfg, shards, s3_prefix, optim={"epochs": 3}, checkpoint={"every_n_steps": 7},
               cluster={"max_restarts_without_progress": 0})
    fault = {"MXPIPE_FAULT_KILL_STEP": "30", "MXPIPE_FAULT_KILL_RANK": "1",
             "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")}
    with pytest.raises(JobFailed) as failed:
        _run(job, s3_prefix, tmp_path, env=fault)
    assert failed.value.role.startswith("worker-")
    assert "SIGKILL" in str(failed.value)
    assert not failed.value.deterministic
    committed = CheckpointStore(job.checkpoint_prefix, keep=cfg.checkpoint.keep).committed_steps()
    assert committed and 0 < committed[0] < 30

    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    _run(job, s3_prefix, tmp_path, env=fault)  # the once-file makes the retry run clean
    resumed = [int(m.group(1)) for m in re.finditer(r"resumed from step (\d+)", caplog.text)]
    assert resumed and resumed[0] == committed[0], caplog.text[-2000:]
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    assert [h["epoch"] for h in metrics["history"]] == [0, 1, 2]


def test_stalled_worker_is_detected_and_every_role_stopped(digits_shards, s3_prefix, tmp_path, caplog):
    cfg, shards = digits_shards
    job = _job(cfg, shards, s3_prefix, cluster={"stall_timeout_s": 8.0})
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    with pytest.raises(JobFailed, match="stalled") as failed:
        _run(job, s3_prefix, tmp_path, env={"MXPIPE_FAULT_HANG_STEP": "5", "MXPIPE_FAULT_KILL_RANK": "0"})
    # It stalled after it had started training, not while starting up.
    assert "started (kvstore=dist_sync)" in str(failed.value)
    # Before they were stopped, the workers dumped their Python stacks: rank 0 in the fault hook,
    # the other waiting for the step's result.
    assert re.search(r"\[worker-\d@[^]]+\] +File .*faults\.py\", line \d+ in maybe_hang", caplog.text), \
        caplog.text[-3000:]
