"""Fault injection for recovery tests: a worker that kills itself (``kill -9``), hangs, gets
SIGTERM at a step, or dies between a checkpoint's data files and its manifest.

Off unless ``MXPIPE_FAULT_KILL_STEP`` / ``_HANG_STEP`` / ``_TERM_STEP`` / ``_KILL_IN_UPLOAD_STEP``
/ ``_STEP_DELAY_S`` is set. ``MXPIPE_FAULT_KILL_RANK`` picks the worker
(default 1). With ``MXPIPE_FAULT_ONCE_FILE`` the fault fires only if that file does not exist,
and creates it, so the retry of the same job runs clean.

``MXPIPE_FAULT_KILL_PID_FILE``: the kill at ``MXPIPE_FAULT_KILL_STEP`` goes to the pid written
in that file instead of the worker itself, so a chaos run can ``kill -9`` any role (a server,
the scheduler) at an exact training step; the worker is only the clock. A negative number is
a process group (as for kill(2)): R3 of the chaos harness kills the S3 server's whole group
that way, so the outage starts at a known step. A missing or
unreadable file means no kill (the once-file is then not created, and the harness sees that
the fault never fired).
"""
from __future__ import annotations

import os
import signal
import time


def maybe_kill(global_step: int, rank: int) -> None:
    target = os.environ.get("MXPIPE_FAULT_KILL_STEP")
    if not target or global_step != int(target) or rank != int(os.environ.get("MXPIPE_FAULT_KILL_RANK", "1")):
        return
    pid = os.getpid()
    pid_file = os.environ.get("MXPIPE_FAULT_KILL_PID_FILE")
    if pid_file:
        try:
            with open(pid_file) as fh:
                pid = int(fh.read().strip())
        except (OSError, ValueError):
            return
    if not _once():
        return
    os.kill(pid, signal.SIGKILL)


def maybe_hang(global_step: int, rank: int) -> None:
    """With ``MXPIPE_FAULT_HANG_STEP`` set, the chosen worker stops making progress (a stall).

    With ``MXPIPE_FAULT_STEP_DELAY_S`` set, every step of the chosen worker takes that much
    longer (a straggler; in ``dist_sync`` the whole job slows with it). The arithmetic is
    untouched, so a delayed job ends with the same parameters as a prompt one: R3 of the chaos
    harness uses it to keep a tiny model training for the whole of a 30 s S3 outage.
    """
    chosen = rank == int(os.environ.get("MXPIPE_FAULT_KILL_RANK", "1"))
    delay = os.environ.get("MXPIPE_FAULT_STEP_DELAY_S")
    if delay and chosen:
        time.sleep(float(delay))
    target = os.environ.get("MXPIPE_FAULT_HANG_STEP")
    if target and global_step == int(target) and chosen:
        while True:
            time.sleep(60)


def _once() -> bool:
    """True if the fault may fire (no once-file configured, or it did not exist and is now made)."""
    once = os.environ.get("MXPIPE_FAULT_ONCE_FILE")
    if not once:
        return True
    try:
        with open(once, "x"):
            return True
    except FileExistsError:
        return False


def maybe_terminate(global_step: int, rank: int) -> None:
    """With ``MXPIPE_FAULT_TERM_STEP`` set, the chosen worker gets SIGTERM (a preemption notice)."""
    target = os.environ.get("MXPIPE_FAULT_TERM_STEP")
    if (target and global_step == int(target) and rank == int(os.environ.get("MXPIPE_FAULT_KILL_RANK", "1"))
            and _once()):
        os.kill(os.getpid(), signal.SIGTERM)


def kill_in_upload_hook() -> "object | None":
    """With ``MXPIPE_FAULT_KILL_IN_UPLOAD_STEP`` set: a ``CheckpointStore.before_commit`` hook that
    SIGKILLs the writer after that step's data files are uploaded, before its manifest (torn)."""
    target = os.environ.get("MXPIPE_FAULT_KILL_IN_UPLOAD_STEP")
    if not target:
        return None

    def hook(step: int) -> None:
        if step == int(target) and _once():
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
