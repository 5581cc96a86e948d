"""Which processes are still ours, and the one way they are stopped.

Identity: a pid alone may have been recycled since we started it, so every record keeps the
process start time too (``start_time``), in clock ticks since boot: the value of field 22 of
``/proc/PID/stat``, which records written before this module used psutil hold as well.

Membership: a group is every live process whose process group is one of the given ids; a
service's group also takes in its whole session and every descendant (Airflow task processes
move to process groups of their own, helpers may start sessions of their own). Zombies are no
members: they have exited and hold nothing but a pid their parent has yet to collect.

Stopping (``stop_groups``) is SIGTERM, a grace period, SIGKILL, for role groups and services
alike. Scans build fresh ``psutil.Process`` objects: psutil's shared ``process_iter`` cache is
not safe when two threads scan at once (the supervisor stops roles while a test polls tags).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Collection, Iterable

import psutil

log = logging.getLogger(__name__)

KILL_WAIT_S = 5.0  # how long SIGKILLed processes get to disappear before they count as survivors
_POLL_S = 0.05
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _ticks(proc: psutil.Process) -> int:
    return round((proc.create_time() - psutil.boot_time()) * _CLOCK_TICKS)


def start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (zombies included), or None if no such pid."""
    try:
        return _ticks(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return None


def is_running(pid: int, started: int) -> bool:
    """True while ``pid`` is the very process that started at ``started`` and has not exited."""
    try:
        proc = psutil.Process(pid)
        return _ticks(proc) == started and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_ours(pid: int, started: int) -> bool:
    """False once ``pid`` belongs to another process; True while it is the process that started
    at ``started`` or has exited (its group may still hold our processes)."""
    now = start_time(pid)
    return now is None or now == started


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _live(pid: int) -> psutil.Process | None:
    """``pid`` as a psutil process, or None if it has exited (zombies included) or vanished."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def _parents() -> dict[int, int]:
    """Parent pid of every process of the machine."""
    out = {}
    for pid in psutil.pids():
        try:
            out[pid] = psutil.Process(pid).ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def group_members(pgids: Iterable[int], *, sessions: bool = False) -> list[psutil.Process]:
    """Live processes whose process group is one of ``pgids``, sorted by pid.

    ``sessions``: also those whose session is one of them, and every descendant of all these.
    """
    wanted = set(pgids)
    pids = psutil.pids()
    # getpgid/getsid are syscalls, far cheaper than reading every /proc/PID/stat.
    found = {pid for pid in pids if _pgid(pid) in wanted}
    if sessions:
        for pid in pids:
            try:
                if os.getsid(pid) in wanted:
                    found.add(pid)
            except ProcessLookupError:
                continue
        children: dict[int, list[int]] = {}
        for pid, ppid in _parents().items():
            children.setdefault(ppid, []).append(pid)
        stack = list(found)
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in found:
                    found.add(child)
                    stack.append(child)
    return [proc for pid in sorted(found) if (proc := _live(pid)) is not None]


def _signal(procs: Iterable[psutil.Process], groups: Collection[int], sig: signal.Signals) -> None:
    """``sig`` once to each process: by group where it is in one of ``groups`` (only groups with
    a live member: an empty group's id may be a new, unrelated group by now), else by itself."""
    live_groups: set[int] = set()
    strays: list[psutil.Process] = []
    for proc in procs:
        pgid = _pgid(proc.pid)
        if pgid in groups:
            live_groups.add(pgid)
        elif pgid is not None:
            strays.append(proc)
    for pgid in live_groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in strays:
        try:
            proc.send_signal(sig)  # psutil refuses if the pid now belongs to another process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def stop_groups(pgids: Iterable[int], *, grace_s: float = 5.0, kill_wait_s: float = KILL_WAIT_S,
                sessions: bool = False) -> list[psutil.Process]:
    """SIGTERM every member of the groups, wait up to ``grace_s`` for all of them to go, then
    SIGKILL what is left and wait up to ``kill_wait_s``. One grace period for all the groups,
    not one each. Returns the survivors: empty when everything is gone."""
    groups = set(pgids)
    left = group_members(groups, sessions=sessions)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        if not left:
            break
        if sig is signal.SIGKILL:
            log.info("%d process(es) still running %.1fs after SIGTERM, sending SIGKILL: %s",
                     len(left), grace_s, [p.pid for p in left])
        _signal(left, groups, sig)
        deadline = time.monotonic() + wait_s
        while (left := group_members(groups, sessions=sessions)) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    return left


def kill_groups(pgids: Iterable[int], *, grace_s: float = 5.0) -> int:
    """``stop_groups`` for role groups; returns how many of the groups had live members."""
    groups = set(pgids)
    alive = {_pgid(p.pid) for p in group_members(groups)} & groups
    stop_groups(alive, grace_s=grace_s)
    return len(alive)


def tagged_processes(key: str, value: str | None = None) -> list[int]:
    """Live pids other than this one whose environment has ``key`` (equal to ``value`` if given).

    Reads ``/proc/PID/environ`` through psutil (needs the same user or root); a role that lost
    its parent is found all the same, which a parent/child walk would miss.
    """
    found = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            env = psutil.Process(pid).environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if key in env and (value is None or env[key] == value) and _live(pid) is not None:
            found.append(pid)
    return found
