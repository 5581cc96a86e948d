"""The supervisor's budget of in-place restarts: failures without progress, not failures.

After a role fails (a crash, a kill, a stall) the supervisor stops every role and starts them
again on the same cluster, where they resume from the newest committed checkpoint: a lost role
costs the roles' start, not an Airflow retry cycle (``training.launch.launcher``). What limits
this is progress, not a count: a restart whose round committed a new checkpoint before it failed
made progress, and a 3-day run at one interruption every few hours may take dozens of them. A
job that fails ``limit`` + 1 times in a row without a new checkpoint (a role that crashes at the
same step each time, a host that cannot run it) is going nowhere, and ends with an error that
says so; that error is not retried (``deterministic``), as a retry would only repeat it.

``limit`` 0 turns restarts off: the first failure ends the job as a retryable one, and the
caller (the Airflow retry, a rerun of ``python -m training run``) runs the job again.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RestartBudget:
    """In-place restarts taken so far, and how many of the last ones came without progress."""

    limit: int
    restarts: int = 0
    without_progress: int = 0  # restarts in a row whose round committed no new checkpoint

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"a restart budget is >= 0, got {self.limit}")

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def take(self, progressed: bool) -> bool:
        """Count the restart after a failure (``progressed``: the failed round committed a new
        checkpoint); False when the budget is spent and the job must end instead."""
        streak = 0 if progressed else self.without_progress + 1
        if not self.enabled or streak > self.limit:
            return False
        self.without_progress = streak
        self.restarts += 1
        return True

    def take_with_progress(self) -> None:
        """Count a restart that loses nothing (after a spot notice, rank 0's emergency checkpoint
        first): never refused, whatever the limit."""
        self.without_progress = 0
        self.restarts += 1

    def exhausted_message(self, since_step: int | None) -> str:
        """Why the job ends when ``take`` said no (``since_step``: the newest checkpoint committed)."""
        where = f"after step {since_step}" if since_step is not None else "yet"
        return (f"gave up after {self.limit} in-place restart(s) in a row without progress (no checkpoint "
                f"committed {where}; cluster.max_restarts_without_progress={self.limit}; {self.restarts} "
                "restart(s) in this job): a retry would fail the same way. The last failure:")
