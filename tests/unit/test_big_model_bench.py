"""benchmarks/big_model.py's P2 arithmetic on a recorded event log: the blocked share of the loop
sums rank 0's commit events, whichever role got rank 0."""
from __future__ import annotations

import pytest

from benchmarks.big_model import blocked_share
from common.events import CheckpointCommitted, Progress, WorkerStarted, event_line

pytestmark = pytest.mark.unit


def event(t: float, ev, role: str) -> dict:
    return {"t": t, "event": "line", "role": role, "text": f"INFO events: {event_line(ev)}"}


def commit(t: float, step: int, blocked_s: float, role: str) -> dict:
    return event(t, CheckpointCommitted(step=step, uri="u", bytes=8, upload_s=1.0, blocked_s=blocked_s), role)


def progress(t: float, step: int) -> dict:
    return event(t, Progress(epoch=0, step=step, steps=100, global_step=step), "worker-0")


def test_blocked_share_counts_rank_0s_commits_whichever_worker_it_is():
    events = [{"t": 0.0, "event": "job_start"},
              event(1.0, WorkerStarted(rank=1, num_workers=2), "worker-0"),
              event(1.0, WorkerStarted(rank=0, num_workers=2), "worker-1"),  # ps-lite gave worker-1 rank 0
              progress(10.0, 10), commit(30.0, 20, 0.5, "worker-1"), progress(60.0, 60),
              {"t": 61.0, "event": "roles_restarting"},
              progress(70.0, 61), commit(80.0, 70, 0.25, "worker-0"), progress(110.0, 100)]
    got = blocked_share(events)
    assert [s["step"] for s in got["saves"]] == [20, 70]
    assert got["loop_s"] == pytest.approx(50.0 + 40.0)
    assert got["blocked_fraction"] == pytest.approx(0.75 / 90.0)
