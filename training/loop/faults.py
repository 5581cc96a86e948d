"""Fault injection for recovery tests: a worker that kills itself (``kill -9``), hangs, gets
SIGTERM at a step, or dies between a checkpoint's data files and its manifest.

Off unless ``MXPIPE_FAULT_KILL_STEP`` (or ``_KILL_STEPS``, comma-separated: a kill at each) /
``_HANG_STEP`` / ``_TERM_STEP`` / ``_KILL_IN_UPLOAD_STEP``
/ ``_STEP_DELAY_S`` is set. ``MXPIPE_FAULT_KILL_RANK`` picks the worker
(default 1). With ``MXPIPE_FAULT_ONCE_FILE`` the fault fires only if that file does not exist,
and creates it, so the retry of the same job runs clean.

``MXPIPE_FAULT_KILL_PID_FILE``: the kill at ``MXPIPE_FAULT_KILL_STEP`` goes to the pid written
in that file instead of the worker itself, so a chaos run can ``kill -9`` any role (a server,
the scheduler) at an exact training step; the worker is only the clock. A negative number is
a process group (as for kill(2)): R3 of the chaos harness kills the S3 server's whole group
that way, so the outage starts at a known step. A missing or
unreadable file means no kill (the once-file is then not created, and the harness sees that
the fault never fired). The file is read when the kill is due, not before: the harness may
write it after the job started.

The variables are read once, into a ``FaultPlan`` (``FaultPlan.from_settings()``, at the start
of the worker's ``run``); the training loop calls ``plan.at_step(global_step, rank)`` after
every step, which returns after one attribute check when no per-step fault is set.
"""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from common.settings import settings


def _steps(text: str) -> tuple[int, ...]:
    """``"15, 35"`` → ``(15, 35)``; a value that is not a list of whole numbers is refused by name."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"MXPIPE_FAULT_KILL_STEPS must be whole numbers separated by commas, got {text!r}") from None


@dataclass(frozen=True)
class FaultPlan:
    """The faults a worker injects, as read from the environment (``common.settings``) once."""

    kill_step: int | None = None
    kill_steps: tuple[int, ...] = ()  # a kill at each, once each (a run that loses several roles)
    kill_rank: int = 1
    kill_pid_file: str | None = None
    hang_step: int | None = None
    term_step: int | None = None
    kill_in_upload_step: int | None = None
    step_delay_s: float | None = None
    once_file: str | None = None
    # Whether ``at_step`` has anything to do at all (derived; false in every job but a test's).
    per_step: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        per_step = bool(self.kill_steps) or any(
            v is not None for v in (self.kill_step, self.hang_step, self.term_step, self.step_delay_s))
        object.__setattr__(self, "per_step", per_step)

    @classmethod
    def from_settings(cls) -> "FaultPlan":
        s = settings()
        return cls(kill_step=s.fault_kill_step, kill_steps=_steps(s.fault_kill_steps), kill_rank=s.fault_kill_rank,
                   kill_pid_file=s.fault_kill_pid_file,
                   hang_step=s.fault_hang_step, term_step=s.fault_term_step,
                   kill_in_upload_step=s.fault_kill_in_upload_step, step_delay_s=s.fault_step_delay_s,
                   once_file=s.fault_once_file)

    def at_step(self, global_step: int, rank: int) -> None:
        """The faults of worker ``rank`` after ``global_step``: kill, then delay or hang, then SIGTERM.
        Only the chosen worker (``kill_rank``) is touched."""
        if not self.per_step or rank != self.kill_rank:
            return
        self.maybe_kill(global_step)
        self.maybe_hang(global_step)
        self.maybe_terminate(global_step)

    # Each fault is a method of its own: a stalled worker's stack dump names the one it is in
    # (tests/integration/test_training_job.py looks for maybe_hang).

    def maybe_kill(self, global_step: int) -> None:
        """At ``kill_step`` or one of ``kill_steps``: SIGKILL this worker, or the pid (or -pgid) in
        ``kill_pid_file``."""
        if global_step == self.kill_step:
            suffix = ""
        elif global_step in self.kill_steps:
            suffix = f"-{global_step}"  # each of the steps fires once
        else:
            return
        pid = os.getpid()
        if self.kill_pid_file:
            try:
                with open(self.kill_pid_file) as fh:
                    pid = int(fh.read().strip())
            except (OSError, ValueError):
                return
        if self._once(suffix):
            os.kill(pid, signal.SIGKILL)

    def maybe_hang(self, global_step: int) -> None:
        """At ``hang_step`` the worker stops making progress (a stall; never returns, no once-file).

        With ``step_delay_s``, every step takes that much longer (a straggler; in ``dist_sync`` the
        whole job slows with it). The arithmetic is untouched, so a delayed job ends with the same
        parameters as a prompt one: R3 of the chaos harness uses it to keep a tiny model training
        for the whole of a 30 s S3 outage.
        """
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if global_step == self.hang_step:
            while True:
                time.sleep(60)

    def maybe_terminate(self, global_step: int) -> None:
        """At ``term_step`` the worker gets SIGTERM (a preemption notice)."""
        if global_step == self.term_step and self._once():
            os.kill(os.getpid(), signal.SIGTERM)

    def before_commit_hook(self) -> Callable[[int], None] | None:
        """With ``kill_in_upload_step`` set: the ``before_commit`` callback the worker builds its
        ``CheckpointStore`` with, which SIGKILLs the writer after that step's data files are
        uploaded, before its manifest (a torn checkpoint); otherwise None (no callback)."""
        if self.kill_in_upload_step is None:
            return None
        target = self.kill_in_upload_step

        def hook(step: int) -> None:
            if step == target and self._once():
                os.kill(os.getpid(), signal.SIGKILL)

        return hook

    def _once(self, suffix: str = "") -> bool:
        """True if the fault may fire (no once-file configured, or it (with ``suffix``) did not
        exist and is now made)."""
        if not self.once_file:
            return True
        try:
            with open(self.once_file + suffix, "x"):
                return True
        except FileExistsError:
            return False
