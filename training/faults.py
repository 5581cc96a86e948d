"""Fault injection for recovery tests: a worker that kills itself (``kill -9``) or hangs at a step.

Off unless ``MXPIPE_FAULT_KILL_STEP`` is set. ``MXPIPE_FAULT_KILL_RANK`` picks the worker
(default 1). With ``MXPIPE_FAULT_ONCE_FILE`` the fault fires only if that file does not exist,
and creates it, so the retry of the same job runs clean.
"""
from __future__ import annotations

import os
import signal


def maybe_kill(global_step: int, rank: int) -> None:
    target = os.environ.get("MXPIPE_FAULT_KILL_STEP")
    if not target or global_step != int(target) or rank != int(os.environ.get("MXPIPE_FAULT_KILL_RANK", "1")):
        return
    once = os.environ.get("MXPIPE_FAULT_ONCE_FILE")
    if once:
        try:
            with open(once, "x"):
                pass
        except FileExistsError:
            return
    os.kill(os.getpid(), signal.SIGKILL)


def maybe_hang(global_step: int, rank: int) -> None:
    """With ``MXPIPE_FAULT_HANG_STEP`` set, the chosen worker stops making progress (a stall)."""
    target = os.environ.get("MXPIPE_FAULT_HANG_STEP")
    if target and global_step == int(target) and rank == int(os.environ.get("MXPIPE_FAULT_KILL_RANK", "1")):
        import time

        while True:
            time.sleep(60)
