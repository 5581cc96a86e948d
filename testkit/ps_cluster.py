"""Run an arbitrary worker script as a real ps-lite job, as every job runs: on the local backend
under a detached supervisor (``local_jobs.run_local``), the workers running the script instead of
``python -m training worker``.

The supervisor owns every role (scheduler, servers, workers) as a process group, fails the job
on the first role death, stall or timeout, and stops every group; ``run_script_job`` also
asserts that nothing was left behind.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from common.config import TrainConfig
from testkit.local_jobs import run_local
from training.launch.job import JobSpec


def run_script_job(worker_argv: Sequence[str], *, num_workers: int, num_servers: int = 1,
                   record_dir: str, timeout_s: float = 300.0,
                   env: Mapping[str, str] | None = None) -> list[str]:
    """Run the job with its document, status record and cluster under ``record_dir``; the names
    of the roles it started."""
    # Only the cluster shape and bounds matter to the supervisor; the worker script picks its kvstore.
    cfg = TrainConfig().replace(cluster={"num_workers": num_workers,
                                         "num_servers": num_servers, "job_timeout_s": timeout_s,
                                         "start_timeout_s": min(120.0, timeout_s),
                                         "stall_timeout_s": min(120.0, timeout_s)})
    folder = os.path.join(record_dir, "job")  # not a record itself: the records' folder holds only records
    os.makedirs(folder, exist_ok=True)
    job = JobSpec(config=cfg, shards_prefix="", checkpoint_prefix="", model_prefix="", metrics_uri="")
    # The helper's own bound is past the job's: the supervisor ends a job past job_timeout_s itself.
    return run_local(job, os.path.join(folder, "job.json"), os.path.join(folder, "home"), env,
                     worker_argv=worker_argv, timeout_s=timeout_s + 120.0)
