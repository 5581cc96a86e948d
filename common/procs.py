"""Process groups: every long-lived child we start gets a session of its own, and is stopped by
signalling the whole group (servers such as MLflow or an MXNet role may fork helpers that would
outlive a plain ``kill pid``).

A ``GroupSpawner`` can record each group it starts in a folder, so a different process (an
Airflow teardown task, a reaper) can find and stop them later. A record holds the pid, the pgid
and the process start time from ``/proc``, so a recycled pid is never mistaken for ours.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/pid/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces or ')'; fields after the last ')' are fixed.
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is ``pgid`` (zombies excluded)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def kill_group(pgid: int, *, grace_s: float = 5.0) -> bool:
    """SIGTERM the group, wait up to ``grace_s``, then SIGKILL what is left. True if any was alive."""
    if not group_members(pgid):
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_members(pgid):
            return True
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + 5.0
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


@dataclass(frozen=True)
class GroupRecord:
    name: str
    pid: int
    pgid: int
    start_time: int

    def is_ours(self) -> bool:
        """True while the recorded leader is still the very process we started."""
        return proc_start_time(self.pid) == self.start_time


class GroupSpawner:
    """Starts commands each in a new session; optionally records them under ``record_dir``."""

    def __init__(self, record_dir: str | None = None) -> None:
        self.record_dir = record_dir
        self.records: list[GroupRecord] = []
        if record_dir:
            os.makedirs(record_dir, exist_ok=True)

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str], *,
              cwd: str | None = None, stdout: int | None = subprocess.PIPE) -> subprocess.Popen:
        proc = subprocess.Popen(
            list(argv), env=dict(env), cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1,
        )
        rec = GroupRecord(name=name, pid=proc.pid, pgid=proc.pid, start_time=proc_start_time(proc.pid) or -1)
        self.records.append(rec)
        if self.record_dir:
            path = os.path.join(self.record_dir, f"{name}.json")
            with open(path, "w") as fh:
                json.dump(asdict(rec), fh)
        return proc

    def kill_all(self, *, grace_s: float = 5.0) -> int:
        return sum(kill_group(r.pgid, grace_s=grace_s) for r in self.records)


def load_records(record_dir: str) -> list[GroupRecord]:
    if not os.path.isdir(record_dir):
        return []
    out = []
    for fname in sorted(os.listdir(record_dir)):
        if fname.endswith(".json"):
            with open(os.path.join(record_dir, fname)) as fh:
                out.append(GroupRecord(**json.load(fh)))
    return out


def kill_recorded(record_dir: str, *, grace_s: float = 5.0) -> list[str]:
    """Stop every recorded group still alive; returns the names of those that were.

    A group whose leader has exited may still hold children, so groups are scanned by pgid; a
    leader pid that now belongs to another process (recycled) is skipped unless members remain.
    """
    stopped = []
    for rec in load_records(record_dir):
        if group_members(rec.pgid) and (rec.is_ours() or proc_start_time(rec.pid) is None):
            if kill_group(rec.pgid, grace_s=grace_s):
                stopped.append(rec.name)
    return stopped
