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
