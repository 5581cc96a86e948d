"""Role groups: started each in a session of its own, recorded so another process can stop them.

A ``GroupSpawner`` can record each group it starts in a folder (one ``<name>.json`` each: name,
pid, pgid, start time), so a different process (an Airflow teardown task, a reaper) can find
and stop them later; the start time tells the process we started from a recycled pid.
``exec_role`` writes the same record on another host and becomes the role.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from common.procs.groups import group_members, kill_groups, start_time, still_ours
from common.procs.watchdog import ends_itself

log = logging.getLogger(__name__)

_WAIT_POLL_S = 0.1


@dataclass(frozen=True)
class GroupRecord:
    name: str
    pid: int
    pgid: int
    start_time: int

    def may_be_ours(self) -> bool:
        return still_ours(self.pid, self.start_time)


class GroupSpawner:
    """Starts commands each in a new session; optionally records them under ``record_dir``."""

    def __init__(self, record_dir: str | None = None) -> None:
        self.record_dir = record_dir
        self.records: list[GroupRecord] = []
        if record_dir:
            os.makedirs(record_dir, exist_ok=True)

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str], *,
              cwd: str | None = None, stdout: int | None = subprocess.PIPE,
              stdin: int = subprocess.DEVNULL) -> subprocess.Popen:
        """Start ``argv`` leading a session of its own. ``stdin=subprocess.PIPE``: a pipe only
        this process writes to (never does), whose end tells the child this process is gone
        (``common.procs.watchdog``); the ``Popen`` keeps it open."""
        proc = subprocess.Popen(
            list(argv), env=dict(env), cwd=cwd, stdout=stdout, stderr=subprocess.STDOUT,
            stdin=stdin, start_new_session=True, text=True, bufsize=1,
        )
        rec = GroupRecord(name=name, pid=proc.pid, pgid=proc.pid, start_time=start_time(proc.pid) or -1)
        self.records.append(rec)
        if self.record_dir:
            with open(os.path.join(self.record_dir, f"{name}.json"), "w") as fh:
                json.dump(asdict(rec), fh)
        return proc

    def kill_all(self, *, grace_s: float = 5.0) -> int:
        return kill_groups((r.pgid for r in self.records), grace_s=grace_s)


def load_records(record_dir: str) -> list[GroupRecord]:
    if not os.path.isdir(record_dir):
        return []
    out = []
    for fname in sorted(os.listdir(record_dir)):
        if fname.endswith(".json"):
            try:
                with open(os.path.join(record_dir, fname)) as fh:
                    out.append(GroupRecord(**json.load(fh)))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping unreadable process record %s: %s", fname, exc)
    return out


def live_records(record_dirs: Iterable[str]) -> list[GroupRecord]:
    """The records under ``record_dirs`` whose group still has live members of ours."""
    return [rec for folder in record_dirs for rec in load_records(folder)
            if group_members([rec.pgid]) and rec.may_be_ours()]


def kill_recorded(record_dir: str, *, grace_s: float = 5.0, wait_s: float = 0.0) -> list[str]:
    """Stop every recorded group still alive; returns the names of those that were.

    Groups are found by pgid, so a group whose leader has exited but whose children remain is
    stopped too; a leader pid that now belongs to another process is left alone. ``wait_s``:
    first give the groups whose role is ending itself (``watchdog.ends_itself``: its supervisor
    is gone) up to that long to exit, before anything is signalled.
    """
    live = live_records([record_dir])
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(ends_itself(rec.pid) for rec in live_records([record_dir])):
        time.sleep(_WAIT_POLL_S)
    kill_groups((rec.pgid for rec in live), grace_s=grace_s)
    return [rec.name for rec in live]


class ProcessRole:
    """A running role as the supervisor sees it: a local process whose output is the role's.

    For a local role the process *is* the role; for a remote one it is the transport's client
    (``ssh``, ``ip netns exec``), whose output and exit status are the remote role's. Stopping
    is the cluster's business (``Cluster.stop_roles``): killing an ssh client alone would leave
    the remote role running.
    """

    def __init__(self, name: str, kind: str, host: str, proc: subprocess.Popen) -> None:
        self.name = name
        self.kind = kind
        self.host = host
        self.proc = proc

    @property
    def stdout(self) -> Iterable[str]:
        return self.proc.stdout if self.proc.stdout is not None else iter(())

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()


def exec_role(record: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Lead a process group of our own, record it, and become ``argv`` (same pid).

    ``env`` replaces the environment (a remote role gets exactly what its cluster computed,
    passed in a 0600 file rather than on a command line where ``ps`` shows secrets).
    """
    try:
        os.setsid()
    except PermissionError:
        pass  # already a group leader (started with start_new_session): nothing to do
    os.makedirs(os.path.dirname(record) or ".", exist_ok=True)
    rec = GroupRecord(name=os.path.basename(record).removesuffix(".json"), pid=os.getpid(),
                      pgid=os.getpgrp(), start_time=start_time(os.getpid()) or -1)
    tmp = f"{record}.tmp"
    with open(tmp, "w") as fh:
        json.dump(asdict(rec), fh)
    os.replace(tmp, record)
    sys.stdout.flush()
    if env is None:
        os.execvp(argv[0], list(argv))
    os.execvpe(argv[0], list(argv), dict(env))
