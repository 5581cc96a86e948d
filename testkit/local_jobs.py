"""Shared by the job tests: build a JobSpec under a prefix and run it as every run does, on the
local backend under a detached supervisor (``training.launch.detached``), asserting that no
process of the job (the supervisor, any role) outlives it."""
import dataclasses
import os
import uuid

from common import storage
from common.procs import Watch
from common.procs.records import load_records
from training.launch.detached import local_cluster, run_detached
from training.launch.job import JobSpec

# Every process of one job carries this tag (the supervisor's environment, which its roles inherit).
TAG = "MXPIPE_JOB_TEST_TAG"
JOB_TIMEOUT_S = 1800.0


def make_job(cfg, shards_prefix, prefix, **overrides):
    cfg = cfg.replace(**overrides) if overrides else cfg
    return JobSpec(config=cfg, shards_prefix=shards_prefix, checkpoint_prefix=storage.join(prefix, "checkpoints"),
                   model_prefix=storage.join(prefix, "model"), metrics_uri=storage.join(prefix, "metrics.json"))


def run_local(job, job_uri, home, env=None, worker_argv=(), timeout_s=JOB_TIMEOUT_S, python=""):
    """Save ``job`` at ``job_uri`` with its status record beside it and a local cluster under
    ``home``, run it detached and wait; the names of the roles it started (every attempt's).
    ``python``: the interpreter of the supervisor and the roles (``local_cluster``)."""
    cluster_id = f"job-{uuid.uuid4().hex[:10]}"
    job = dataclasses.replace(job, status_uri=storage.join(job_uri.rsplit("/", 1)[0], "job_status.json"),
                              cluster=local_cluster(cluster_id, job.config, home=home, worker_argv=worker_argv,
                                                    python=python))
    job.save(job_uri)
    tag = (TAG, uuid.uuid4().hex)
    try:
        run_detached(job_uri, env={**os.environ, **(env or {}), tag[0]: tag[1]}, timeout_s=timeout_s)
    finally:
        Watch(tags=[tag]).check("the job's supervisor and roles")
    procs = os.path.join(home, "clusters", cluster_id, "procs")
    return [rec.name for attempt in sorted(os.listdir(procs)) for rec in load_records(os.path.join(procs, attempt))]


def run_job(job, prefix, tmp_path, env=None):
    """Run ``job`` (its document at ``prefix``/job.json) on a local cluster; its role names."""
    return run_local(job, storage.join(prefix, "job.json"), str(tmp_path / "home"), env)


def shard_digits(prefix, digits_csv, **data):
    """The digits table uploaded under ``prefix`` and sharded with the ``debug`` recipe (``data``:
    fields of its data section to change): (config, shards prefix)."""
    from common.config import recipe
    from data_checks.shard import shard_dataset

    source = storage.join(prefix, "digits.csv")
    storage.put_bytes(source, digits_csv)
    cfg = recipe("debug", source).replace(data=data) if data else recipe("debug", source)
    shard_dataset(cfg, storage.join(prefix, "shards"))
    return cfg, storage.join(prefix, "shards")


def checkpoint_params(job, step):
    """The parameters of the job's checkpoint at ``step``, by structural name."""
    import io

    import numpy as np

    from training.checkpoint.store import store_for

    ckpt = store_for(job.checkpoint_prefix, job.config.checkpoint).load(step)
    with np.load(io.BytesIO(ckpt.files["params.npz"])) as arrays:
        return {k: arrays[k].copy() for k in arrays.files}
