"""A cluster whose roles are shell scripts (one per role name; default: sleep), standing in for
ps-lite roles so the supervisor's guarantees are tested in seconds. ``attach`` builds one from a
description, so a job document can name it (``tests.unit.script_cluster:attach``) and
``python -m training supervise`` runs it in a process of its own."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from common.procs import GroupSpawner, ProcessRole, kill_groups
from common.roles import JobLaunch

FACTORY = "tests.unit.script_cluster:attach"


class ScriptCluster:
    def __init__(self, record_dir: str, env: Mapping[str, str], scripts: Mapping[str, str]) -> None:
        self.spawner = GroupSpawner(record_dir)
        self.env = dict(env)
        self.scripts = dict(scripts)
        self.launches: list[JobLaunch] = []

    def start_roles(self, launch: JobLaunch) -> list[ProcessRole]:
        self.launches.append(launch)
        out = []
        for role in launch.roles():
            script = self.scripts.get(role.name, "echo up; sleep 300")
            proc = self.spawner.spawn(role.name, ["sh", "-c", script], {**os.environ, **self.env})
            out.append(ProcessRole(role.name, role.kind, f"host-{role.name}", proc))
        return out

    def stop_roles(self, handles: Any, *, grace_s: float = 5.0) -> int:
        return kill_groups((h.proc.pid for h in handles), grace_s=grace_s)


def description(record_dir: str, env: Mapping[str, str], scripts: Mapping[str, str]) -> dict[str, Any]:
    return {"factory": FACTORY, "description": {"record_dir": record_dir, "env": dict(env), "scripts": dict(scripts)}}


def attach(desc: Mapping[str, Any]) -> ScriptCluster:
    return ScriptCluster(desc["record_dir"], desc["env"], desc["scripts"])
