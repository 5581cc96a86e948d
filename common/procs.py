"""Process groups: every long-lived child we start gets a session of its own, and is stopped by
signalling the whole group (servers such as MLflow or an MXNet role may fork helpers that would
outlive a plain ``kill pid``).

A ``GroupSpawner`` can record each group it starts in a folder, so a different process (an
Airflow teardown task, a reaper) can find and stop them later. A record holds the pid, the pgid
and the process start time from ``/proc``, so a recycled pid is never mistaken for ours.

The same records work on another host: ``python -m common.procs exec-role --record F -- ARGV``
makes the role lead its own group, writes its record and ``exec``s the role (same pid), and
``python -m common.procs kill-records DIR`` stops them, both run through a cluster's transport
(ssh, ``ip netns exec``, SSM). ``tagged_processes`` scans every process on the machine for an
environment tag, which finds a role even after its parent died and it was re-parented to init:
the tests' proof that nothing was left behind.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from common.cli import parser as cli_parser

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


def kill_groups(pgids: Iterable[int], *, grace_s: float = 5.0) -> int:
    """``kill_group`` for many groups at once: one grace period in all, not one per group.

    Returns how many of the groups had live members.
    """
    alive = [g for g in dict.fromkeys(pgids) if group_members(g)]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for g in alive:
            try:
                os.killpg(g, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(group_members(g) for g in alive):
            time.sleep(0.05)
        if not any(group_members(g) for g in alive):
            break
    return len(alive)


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


def kill_recorded(record_dir: str, *, grace_s: float = 5.0) -> list[str]:
    """Stop every recorded group still alive; returns the names of those that were.

    A group whose leader has exited may still hold children, so groups are scanned by pgid; a
    leader pid that now belongs to another process (recycled) is skipped unless members remain.
    """
    live = [rec for rec in load_records(record_dir)
            if group_members(rec.pgid) and (rec.is_ours() or proc_start_time(rec.pid) is None)]
    kill_groups((rec.pgid for rec in live), grace_s=grace_s)
    return [rec.name for rec in live]


def tagged_processes(key: str, value: str | None = None) -> list[int]:
    """Live pids (not zombies) whose environment has ``key`` (equal to ``value`` if given).

    Reads ``/proc/PID/environ`` of every process (needs the same user or root); a role that
    lost its parent is found all the same, which a parent/child walk would miss.
    """
    needle = f"{key}=".encode() + (value.encode() if value is not None else b"")
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                items = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:].split()[0] == "Z":
            continue
        if any(item == needle if value is not None else item.startswith(needle) for item in items):
            found.append(int(entry))
    return sorted(found)


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
                      pgid=os.getpgrp(), start_time=proc_start_time(os.getpid()) or -1)
    tmp = f"{record}.tmp"
    with open(tmp, "w") as fh:
        json.dump(asdict(rec), fh)
    os.replace(tmp, record)
    sys.stdout.flush()
    if env is None:
        os.execvp(argv[0], list(argv))
    os.execvpe(argv[0], list(argv), dict(env))


def free_port(host: str) -> int:
    """A TCP port that was free on ``host`` a moment ago (the scheduler binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


EXAMPLES = """
python -m common.procs exec-role --record /tmp/job/procs/worker-0.json -- python -m training worker JOB_URI
python -m common.procs kill-records /tmp/job/procs --grace-s 5
python -m common.procs free-port 127.0.0.1
"""


def main(argv: list[str] | None = None) -> int:
    """Host-side helpers a cluster runs through its transport (nothing here imports mxnet)."""
    parser = cli_parser("Host-side helpers a cluster runs through its transport (ssh, ip netns exec, SSM): "
                        "start a role as the leader of a recorded process group, stop the recorded groups, "
                        "find a free port.", EXAMPLES, prog="python -m common.procs")
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("exec-role", help="lead a new process group, record it, exec ARGV")
    e.add_argument("--record", required=True)
    e.add_argument("--env-file", help="JSON {name: {VAR: value}}: the environment to exec with")
    e.add_argument("--env-key", help="which entry of --env-file (default: the record's name)")
    e.add_argument("argv", nargs=argparse.REMAINDER)
    k = sub.add_parser("kill-records", help="stop every recorded group under DIR (recursively)")
    k.add_argument("dir")
    k.add_argument("--grace-s", type=float, default=5.0)
    f = sub.add_parser("free-port", help="print a TCP port free on ADDRESS")
    f.add_argument("address")
    args = parser.parse_args(argv)
    if args.cmd == "exec-role":
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not cmd:
            parser.error("exec-role needs a command after --")
        env = None
        if args.env_file:
            with open(args.env_file) as fh:
                key = args.env_key or os.path.basename(args.record).removesuffix(".json")
                env = json.load(fh)[key]
        exec_role(args.record, cmd, env)
    if args.cmd == "kill-records":
        stopped: list[str] = []
        for root, _dirs, files in os.walk(args.dir):
            if any(f.endswith(".json") for f in files):
                stopped += kill_recorded(root, grace_s=args.grace_s)
        print(json.dumps({"stopped": stopped}))
        return 0
    print(free_port(args.address))
    return 0


if __name__ == "__main__":
    sys.exit(main())
