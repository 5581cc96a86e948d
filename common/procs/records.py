"""Process groups we start, each in a session of its own, recorded so another process can stop them.

A ``GroupRecord`` is one such group: its leader's pid, process group and start time (the start
time tells the process we started from a recycled pid), and for a service (``infra.processes``)
its log, port, command line and the file the record is kept in. A ``GroupSpawner`` can record
each group it starts in a folder (one ``<name>.json`` each), so a different process (an Airflow
teardown task, a reaper) can find and stop them later; ``exec_role`` writes the same record on
another host and becomes the role.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from common.procs.groups import group_members, is_running, kill_groups, start_time, still_ours, stop_groups
from common.procs.watchdog import ends_itself

log = logging.getLogger(__name__)

SIGKILL_WAIT_S = 10.0  # how long a stopped service's SIGKILLed processes get to disappear
_WAIT_POLL_S = 0.1



@dataclass
class GroupRecord:
    """One started process group: the leader of its own session and process group."""

    name: str
    pid: int
    pgid: int
    start_time: int  # common.procs.start_time, to tell our process from a reused pid
    # What a service's record adds (infra.processes.launch); a role's record leaves them unset.
    log_path: str | None = None
    port: int | None = None
    cmd: tuple[str, ...] = ()
    started_at: float = 0.0
    pid_file: str | None = None  # where this record is kept; removed once the group is stopped
    # The launched leader, when this process started it: stopping collects its exit status.
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def may_be_ours(self) -> bool:
        """False if the pid now belongs to another process (then its group is not ours)."""
        return still_ours(self.pid, self.start_time)

    def is_running(self) -> bool:
        return is_running(self.pid, self.start_time)

    def processes(self) -> list[int]:
        """Pids of the group's live processes, with its whole session and their descendants."""
        return [p.pid for p in group_members([self.pgid], sessions=True)] if self.may_be_ours() else []

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM the whole session, SIGKILL what is left after ``timeout``; True if all gone."""
        if not self.may_be_ours():
            log.warning("%s: pid %s was reused by another process; not signalling", self.name, self.pid)
            self._remove_pid_file()
            return True
        left = stop_groups([self.pgid], grace_s=timeout, kill_wait_s=SIGKILL_WAIT_S, sessions=True)
        self.reap()
        if left:
            log.error("%s: processes %s survived SIGKILL", self.name, [p.pid for p in left])
            return False
        self._remove_pid_file()
        return True

    def wait(self, timeout: float) -> int:
        """The exit status of a leader this process launched, waiting up to ``timeout`` seconds
        (``subprocess.TimeoutExpired`` after that)."""
        if self._popen is None:
            raise ValueError(f"{self.name}: pid {self.pid} was not launched by this process; cannot wait for it")
        return self._popen.wait(timeout=timeout)

    def reap(self) -> None:
        """Collect the exit status of a leader this process launched, if it has exited (so no
        zombie is left)."""
        if self._popen is not None:
            self._popen.poll()

    def _remove_pid_file(self) -> None:
        if self.pid_file:
            Path(self.pid_file).unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the group's log ("" without one)."""
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 16384))
                text = fh.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def to_json(self) -> str:
        """The record as a file holds it: the fields that are set (a role's: name, pid, pgid,
        start time)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)
                if not f.name.startswith("_") and getattr(self, f.name) != f.default}
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "GroupRecord":
        data = json.loads(text)
        return cls(**data | {"cmd": tuple(data.get("cmd", ()))})


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
                fh.write(rec.to_json())
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
                    out.append(GroupRecord.from_json(fh.read()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping unreadable process record %s: %s", fname, exc)
    return out


def live_records(record_dirs: Iterable[str]) -> list[GroupRecord]:
    """The records under ``record_dirs`` whose group still has live members of ours."""
    return [rec for folder in record_dirs for rec in load_records(folder)
            if group_members([rec.pgid]) and rec.may_be_ours()]


def kill_recorded(record_dir: str, *, grace_s: float = 5.0, wait_s: float = 0.0,
                  names: Collection[str] | None = None) -> list[str]:
    """Stop every recorded group still alive (only those named in ``names``, if given); returns
    the names of those that were.

    Groups are found by pgid, so a group whose leader has exited but whose children remain is
    stopped too; a leader pid that now belongs to another process is left alone. ``wait_s``:
    first give the groups whose role is ending itself (``watchdog.ends_itself``: its supervisor
    is gone) up to that long to exit, before anything is signalled.
    """
    def chosen() -> list[GroupRecord]:
        return [rec for rec in live_records([record_dir]) if names is None or rec.name in names]

    live = chosen()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(ends_itself(rec.pid) for rec in chosen()):
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
        fh.write(rec.to_json())
    os.replace(tmp, record)
    sys.stdout.flush()
    if env is None:
        os.execvp(argv[0], list(argv))
    os.execvpe(argv[0], list(argv), dict(env))
