"""Shared by the job tests: build a JobSpec under a prefix and run it on local role processes,
asserting that no role process outlives the job."""
import os

from common import storage
from common.procs import GroupSpawner, Watch, free_port
from training.launch.job import JobSpec
from training.launch.launcher import Supervisor


def make_job(cfg, shards_prefix, prefix, **overrides):
    cfg = cfg.replace(**overrides) if overrides else cfg
    return JobSpec(config=cfg, shards_prefix=shards_prefix, checkpoint_prefix=storage.join(prefix, "checkpoints"),
                   model_prefix=storage.join(prefix, "model"), metrics_uri=storage.join(prefix, "metrics.json"))


def run_job(job, prefix, tmp_path, env=None, observer=None):
    job_uri = storage.join(prefix, "job.json")
    job.save(job_uri)
    record_dir = str(tmp_path / f"procs-{len(os.listdir(tmp_path))}")
    spawner = GroupSpawner(record_dir)
    sup = Supervisor(job.config, spawner, host="127.0.0.1", port=free_port(), base_env={**os.environ, **(env or {})},
                     observer=observer)
    try:
        sup.run(job_uri)
    finally:
        Watch(record_dirs=[record_dir]).check("the job's roles")
    return spawner


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
