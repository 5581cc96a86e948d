"""The soak's failure source: ``kill -9`` of a random live role every ``period_s`` seconds.

Roles are found through the cluster's own records, never by a name search over the machine: the
local backend records each role it starts under
``$MXPIPE_HOME/clusters/<id>/procs/<attempt>/<role>.json`` (name, pid, start time;
``common.procs.records``). Only the newest attempt's records count (an older attempt's roles may
still be in their teardown), a record counts only while its process is alive and still the one
started (start time), and its command line must be a role's (``training worker`` or the
ps-lite ``import_mxnet`` one-liner of a scheduler or server): the soak's ``MXPIPE_HOME`` is a
folder of its own, so nothing outside the run can be picked. The victim is a seeded uniform
choice among the live roles sorted by name, so a seed gives the same sequence of choices for the
same set of live roles.
"""
from __future__ import annotations

import glob
import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.procs.records import live_records

ROLE_COMMANDS = {"worker": "training worker", "server": "import_mxnet", "scheduler": "import_mxnet"}


@dataclass(frozen=True, order=True)
class LiveRole:
    name: str  # scheduler, server-0, worker-1, …
    pid: int

    @property
    def kind(self) -> str:
        return self.name.split("-")[0]


def choose_victim(roles: list[LiveRole], rng: random.Random) -> LiveRole:
    """A uniform choice among ``roles``, independent of the order they were found in."""
    if not roles:
        raise ValueError("no live role to kill")
    return rng.choice(sorted(roles))


def is_role_command(kind: str, cmdline: list[str]) -> bool:
    """Whether a process's command line is that of a role of ``kind`` (``common.roles.role_argv``)."""
    expected = ROLE_COMMANDS.get(kind)
    return expected is not None and expected in " ".join(cmdline)


def live_roles(home: str) -> list[LiveRole]:
    """The live roles of the newest attempt recorded under ``home`` (module docstring)."""
    attempts = glob.glob(os.path.join(home, "clusters", "*", "procs", "*"))
    if not attempts:
        return []
    return live_roles_in([max(attempts, key=os.path.getmtime)])


def live_hosts_roles(state_dir: str, cluster_id: str) -> list[LiveRole]:
    """The live roles of the newest attempt of a ``hosts`` cluster whose hosts share this
    machine's filesystem and process table (``testkit.netns_hosts``): each host records its roles
    under ``<state_dir>/<cluster>/<host>/<attempt>/procs`` (``infra.hosts_cluster``), the same
    attempt name on every host."""
    folders = glob.glob(os.path.join(state_dir, cluster_id, "*", "attempt-*", "procs"))
    if not folders:
        return []
    newest = os.path.basename(os.path.dirname(max(folders, key=os.path.getmtime)))
    return live_roles_in([f for f in folders if os.path.basename(os.path.dirname(f)) == newest])


def live_roles_in(folders: list[str]) -> list[LiveRole]:
    """The live roles recorded in ``folders`` whose command line is a role's."""
    import psutil

    out = []
    for rec in live_records(folders):
        try:
            cmdline = psutil.Process(rec.pid).cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if is_role_command(rec.name.split("-")[0], cmdline):
            out.append(LiveRole(rec.name, rec.pid))
    return out


class Killer(threading.Thread):
    """Kills one live role at ``t0 + k × period_s`` (k = 1, 2, …, at most ``max_kills``), where
    ``t0`` is the first ``job_start`` in the events file; records each kill (time, role, pid)."""

    def __init__(self, home: str, events_file: Path, period_s: float, seed: int, max_kills: int) -> None:
        super().__init__(name="soak-killer", daemon=True)
        self.home, self.events_file, self.period_s, self.max_kills = home, events_file, period_s, max_kills
        self.rng = random.Random(seed)
        self.kills: list[dict[str, Any]] = []
        self.stopping = threading.Event()

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)

    def _job_start(self) -> float | None:
        while not self.stopping.wait(0.5):
            if self.events_file.exists():
                for line in self.events_file.read_text().splitlines():
                    if '"job_start"' in line:
                        return float(json.loads(line)["t"])
        return None

    def run(self) -> None:
        t0 = self._job_start()
        if t0 is None:
            return
        for k in range(1, self.max_kills + 1):
            if self.stopping.wait(max(0.0, t0 + k * self.period_s - time.time())):
                return
            while not self.stopping.is_set():
                roles = live_roles(self.home)
                if roles:
                    victim = choose_victim(roles, self.rng)
                    t = time.time()
                    try:
                        os.kill(victim.pid, signal.SIGKILL)
                    except ProcessLookupError:  # ended between the look and the kill: pick again
                        continue
                    self.kills.append({"t": t, "role": victim.name, "pid": victim.pid})
                    print(f"killed {victim.name} (pid {victim.pid}) at +{t - t0:.1f} s", flush=True)
                    break
                self.stopping.wait(0.5)  # between attempts: no role alive yet
