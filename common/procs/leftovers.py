"""Proof that a run left nothing behind: every process it started has exited.

A ``Watch`` names what a run started: environment tags its processes carry (found even after
they were re-parented to init), process groups, a ``GroupSpawner``'s record folders, service
sessions, and any other source of pids (``probe``: the processes of a network namespace). ``left`` gives processes that are just exiting a bounded time; ``check`` fails with
the pid and command line of each one still running, and kills them, so that a failed proof does
not leave them running on a shared machine. The tests' ``nothing_left`` fixture and the
benchmarks both use it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil

from common.procs.groups import group_members, tagged_processes
from common.procs.records import load_records

LEFTOVER_WAIT_S = 10.0
_POLL_S = 0.2


class LeftBehind(RuntimeError):
    """Processes of a run were still running after it ended."""


@dataclass
class Watch:
    """The processes of one run, by every handle it has on them; the adders return the watch."""

    tags: list[tuple[str, str]] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    sessions: list[int] = field(default_factory=list)
    record_dirs: list[str] = field(default_factory=list)
    probes: list[Callable[[], Iterable[int]]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """Environment entries that put a process under this watch."""
        return dict(self.tags)

    def tag(self, key: str, value: str) -> Watch:
        self.tags.append((key, value))
        return self

    def group(self, pgid: int) -> Watch:
        self.groups.append(pgid)
        return self

    def session(self, pgid: int) -> Watch:
        """A service's session: its groups and every descendant (``group_members(sessions=True)``)."""
        self.sessions.append(pgid)
        return self

    def records(self, record_dir: str) -> Watch:
        self.record_dirs.append(record_dir)
        return self

    def probe(self, pids: Callable[[], Iterable[int]]) -> Watch:
        """Any other source of pids that must all be gone."""
        self.probes.append(pids)
        return self

    def running(self) -> list[int]:
        """Pids of watched processes running now."""
        pids = {pid for key, value in self.tags for pid in tagged_processes(key, value)}
        pgids = self.groups + [rec.pgid for folder in self.record_dirs for rec in load_records(folder)
                               if rec.may_be_ours()]
        if pgids:
            pids.update(p.pid for p in group_members(pgids))
        if self.sessions:
            pids.update(p.pid for p in group_members(self.sessions, sessions=True))
        for probe in self.probes:
            pids.update(probe())
        return sorted(pids)

    def left(self, wait_s: float | None = None) -> list[int]:
        """Pids still running after up to ``wait_s`` (default ``LEFTOVER_WAIT_S``; returns as
        soon as none is)."""
        deadline = time.monotonic() + (LEFTOVER_WAIT_S if wait_s is None else wait_s)
        while (pids := self.running()) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return pids

    def check(self, what: str = "the run", wait_s: float | None = None) -> None:
        """Raise ``LeftBehind`` naming every process still running after ``wait_s``, once they
        are killed."""
        pids = self.left(wait_s)
        if not pids:
            return
        report = "\n".join(f"  pid {pid}: {_cmdline(pid)}" for pid in pids)
        for pid in pids:
            try:
                psutil.Process(pid).kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        raise LeftBehind(f"{what} left {len(pids)} process(es) running (now killed):\n{report}")


def _cmdline(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        return " ".join(proc.cmdline()) or f"[{proc.name()}]"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "(exited meanwhile)"
