"""A real local job that gets a spot interruption notice mid-training, and what it cost.

``run_with_notice`` runs a job (``testkit.local_jobs``) with every role's spot watch on, pointed
at a fake metadata server (``testkit.metadata_server``), and switches the notice on once the job's
status record shows rank 0 at ``notice_at_step``. The supervisor's event log
(``MXPIPE_EVENTS_FILE``) then says what happened and what it cost (``NoticeOutcome``): the
emergency checkpoint rank 0 wrote when the supervisor acted (the step it had reached: it finishes
its step, saves and exits), the step the next round resumed from, and the newest checkpoint
before the notice, where a crash at the same moment would have resumed from. Used by
``tests/integration/test_spot_watch.py`` and ``benchmarks/spot_notice.py``.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import storage
from common.events import CheckpointCommitted, FirstStepAfterResume, Resumed, parse_event
from testkit.local_jobs import run_job
from testkit.waits import wait_for
from training.launch.status import read_status

WATCH_POLL_S = 0.1


@dataclass(frozen=True)
class NoticeOutcome:
    emergency_step: int  # rank 0's checkpoint after the notice: the step it had reached
    resumed_from: int  # the step the restarted roles resumed from
    newest_before_notice: int  # the newest checkpoint committed before it (a crash's resume point)
    restarts: int
    seconds_to_first_step: float  # notice acted on → the restarted job's first step after resume

    @property
    def steps_lost(self) -> int:
        return max(0, self.emergency_step - self.resumed_from)

    @property
    def steps_lost_by_a_crash(self) -> int:
        """What a crash at the same moment would have lost: back to the newest checkpoint."""
        return max(0, self.emergency_step - self.newest_before_notice)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "steps_lost": self.steps_lost, "steps_lost_by_a_crash": self.steps_lost_by_a_crash}


def run_with_notice(job: Any, prefix: str, tmp_path: Path, fake: Any, notice_at_step: int,
                    env: dict[str, str] | None = None, timeout_s: float = 600.0) -> NoticeOutcome:
    """Run ``job`` under ``prefix`` with the notice switched on at ``notice_at_step``; the outcome."""
    events_file = tmp_path / f"events-{Path(prefix).name}.jsonl"
    status_uri = storage.join(prefix, "job_status.json")
    failure: list[BaseException] = []

    def run() -> None:
        try:
            run_job(job, prefix, tmp_path, {**fake.watching(WATCH_POLL_S), "MXPIPE_EVENTS_FILE": str(events_file),
                                            **(env or {})})
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(exc)

    fake.clear()
    runner = threading.Thread(target=run, name="spot-job", daemon=True)
    runner.start()
    wait_for(lambda: (s := read_status(status_uri)) is not None and s.global_step >= notice_at_step or failure
             or not runner.is_alive(), timeout_s=timeout_s, what=f"rank 0 at step {notice_at_step}")
    fake.notice("terminate", "2026-12-06T20:13:00Z")
    runner.join(timeout_s)
    fake.clear()
    if failure:
        raise failure[0]
    if runner.is_alive():
        raise TimeoutError(f"the job did not end within {timeout_s:.0f}s")
    return outcome_of(events_file, status_uri)


def outcome_of(events_file: Path, status_uri: str) -> NoticeOutcome:
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    acted = next(e for e in events if e["event"] == "spot_interruption")
    restart = next(e for e in events if e["event"] == "roles_restarting" and e["t"] >= acted["t"])

    def worker_events(kind: type, after: float, before: float = float("inf")) -> list[tuple[float, Any]]:
        out = []
        for e in events:
            if e["event"] == "line" and e["role"].startswith("worker-") and after <= e["t"] <= before:
                if isinstance(got := parse_event(e["text"]), kind):
                    out.append((e["t"], got))
        return out

    before = [ev.step for _, ev in worker_events(CheckpointCommitted, 0.0, acted["t"])]
    emergency = [ev.step for _, ev in worker_events(CheckpointCommitted, acted["t"], restart["t"])]
    resumed = worker_events(Resumed, restart["t"])
    first = [t for t, ev in worker_events(FirstStepAfterResume, restart["t"])]
    status = read_status(status_uri)
    return NoticeOutcome(emergency_step=max(emergency, default=-1),
                         resumed_from=resumed[0][1].step, newest_before_notice=max(before, default=0),
                         restarts=status.restarts if status else 0,
                         seconds_to_first_step=(first[0] - acted["t"]) if first else float("nan"))
