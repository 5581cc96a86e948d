"""What process trees consume: CPU time (core-seconds), CPU % and resident memory, per named tree.

A supervisor samples its roles with ``UsageMeter.sample({role: pid})``: each role is its root
process and every descendant alive at the sample. CPU time is ``user + system`` of each process,
remembered per process (pid and start time, so a recycled pid is a new process) at its last
sample, and a tree's core-seconds is the sum over every process ever seen in it. So a process
that exits keeps the time it had at its last sample: what it used after that, up to one sampling
interval, is not counted, and a descendant born and gone between two samples is missed. The
``children_*`` fields of ``cpu_times`` (exited children a process waited for) are left out: they
would count a sampled child twice. CPU % is the growth of core-seconds over the wall time
between two samples (100 = one core busy). Resident memory is the sum over the tree's live
processes (pages shared between them count once per process); a process that reads as 0 bytes
resident (exiting: its memory released, not yet a zombie) adds nothing, and a sample in which
every process of the tree reads so keeps the tree's last resident figure.

GPU time is not measured here (psutil sees no GPU); ``first_seen``/``last_seen`` give a tree's
lifetime, from which a caller may derive the GPU-seconds allocated to it.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import psutil


@dataclass
class TreeUsage:
    """One tree's totals so far and its latest sample."""

    core_seconds: float = 0.0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    first_seen: float = 0.0  # monotonic
    last_seen: float = 0.0
    _per_process: dict[tuple[int, float], float] = field(default_factory=dict, repr=False)

    @property
    def seconds_alive(self) -> float:
        return max(self.last_seen - self.first_seen, 0.0)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


class UsageMeter:
    """Core-seconds, CPU % and RSS of named process trees, by sampling."""

    def __init__(self) -> None:
        self.trees: dict[str, TreeUsage] = {}

    def sample(self, roots: Mapping[str, int]) -> dict[str, TreeUsage]:
        """Sample every tree in ``roots`` (name → root pid) that is still running; returns all
        trees seen so far (an exited one keeps its totals)."""
        for name, pid in roots.items():
            procs = _tree(pid)
            if not procs:
                continue
            now = time.monotonic()
            usage = self.trees.setdefault(name, TreeUsage(first_seen=now, last_seen=now))
            rss, read, resident = 0, 0, 0
            for proc in procs:
                try:
                    with proc.oneshot():
                        # An exited process not yet reaped reads as 0 bytes resident: not a sample.
                        if proc.status() == psutil.STATUS_ZOMBIE:
                            continue
                        times = proc.cpu_times()
                        held = proc.memory_info().rss
                        key = (proc.pid, proc.create_time())
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                usage._per_process[key] = times.user + times.system
                read += 1
                # An exiting process has released its memory before it becomes a zombie: 0 bytes
                # resident then is no sample of its memory (its CPU time still counts).
                if held:
                    rss, resident = rss + held, resident + 1
            if not read:  # exited (a zombie until reaped): keep its last live sample
                continue
            before, elapsed = usage.core_seconds, now - usage.last_seen
            usage.core_seconds = sum(usage._per_process.values())
            if elapsed > 0:
                usage.cpu_percent = 100.0 * (usage.core_seconds - before) / elapsed
            if resident:  # else every process of the tree is exiting: its last live RSS stands
                usage.rss_bytes = rss
            usage.last_seen = now
        return self.trees
