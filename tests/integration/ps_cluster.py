"""Run an arbitrary worker script as a real ps-lite job under the project's Supervisor.

The Supervisor owns every role (scheduler, servers, workers) as a process group, fails the job
on the first role death, stall or timeout, and stops every group; ``run_script_job`` also
asserts that nothing was left behind.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from common.procs import GroupSpawner, Watch, free_port
from common.config import TrainConfig
from training.launch.launcher import Supervisor


class ScriptSupervisor(Supervisor):
    """The project's Supervisor, with the workers running ``worker_argv`` and per-role env extras."""

    def __init__(self, cfg: TrainConfig, spawner: GroupSpawner, worker_argv: Sequence[str],
                 base_env: Mapping[str, str], role_extra_env: Mapping[str, Mapping[str, str]]) -> None:
        super().__init__(cfg, spawner, host="127.0.0.1", port=free_port(), base_env=base_env)
        self.worker_argv = list(worker_argv)
        self.role_extra_env = role_extra_env

    def _start(self, name: str, kind: str, argv: list[str]) -> None:  # type: ignore[override]
        base = self.base_env
        self.base_env = {**base, **self.role_extra_env.get(kind, {})}
        try:
            super()._start(name, kind, self.worker_argv if kind == "worker" else argv)
        finally:
            self.base_env = base


def run_script_job(worker_argv: Sequence[str], *, num_workers: int, num_servers: int = 1,
                   record_dir: str, timeout_s: float = 300.0,
                   env: Mapping[str, str] | None = None,
                   role_extra_env: Mapping[str, Mapping[str, str]] | None = None) -> list[str]:
    # Only the cluster shape and bounds matter to the Supervisor; the worker script picks its kvstore.
    cfg = TrainConfig().replace(cluster={"num_workers": num_workers,
                                         "num_servers": num_servers, "job_timeout_s": timeout_s,
                                         "start_timeout_s": min(120.0, timeout_s),
                                         "stall_timeout_s": min(120.0, timeout_s)})
    spawner = GroupSpawner(record_dir)
    sup = ScriptSupervisor(cfg, spawner, worker_argv, {**os.environ, **(env or {})}, role_extra_env or {})
    try:
        sup.run("unused")
    finally:
        Watch(record_dirs=[record_dir]).check("the job's roles")
    return [r.name for r in spawner.records]
