"""How many threads wanted a core while a benchmark ran: the machine's run queue, sampled.

The planner's time model (``infra.perf_model.fair_share``) slows a CPU-bound phase by
``runnable / cores`` when more threads want the cores than there are. On a machine shared with
other work that count is not the job's own, so a benchmark samples it (``procs_running`` of
``/proc/stat``: runnable threads, machine-wide, the sampler's own read included) every
``every_s`` and reports its mean over any window of wall-clock time (``time.time()``, the clock of
the job's event log). Not the load average: that is a 1-minute mean which also counts threads
asleep in uninterruptible I/O.
"""
from __future__ import annotations

import time

from testkit.periodic import PeriodicSampler


def procs_running() -> int | None:
    """Runnable threads now (``/proc/stat``); None where there is no such file."""
    try:
        with open("/proc/stat") as fh:
            for line in fh:
                if line.startswith("procs_running "):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class RunQueueSampler(PeriodicSampler):
    """``with RunQueueSampler() as rq: ...`` then ``rq.mean(t0, t1)``."""

    def __init__(self, every_s: float = 0.25) -> None:
        super().__init__(every_s, "run-queue", join_timeout_s=5)
        self.samples: list[tuple[float, int]] = []

    def sample(self) -> None:
        n = procs_running()
        if n is not None:
            self.samples.append((time.time(), n))

    def mean(self, t0: float, t1: float) -> float | None:
        """Mean runnable threads over ``[t0, t1]`` (the nearest sample for a window shorter than a period)."""
        inside = [n for t, n in self.samples if t0 <= t <= t1]
        if inside:
            return sum(inside) / len(inside)
        if not self.samples:
            return None
        mid = (t0 + t1) / 2
        return float(min(self.samples, key=lambda s: abs(s[0] - mid))[1])
