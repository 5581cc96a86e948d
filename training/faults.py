"""Fault injection for recovery tests: ``kill -9`` of the worker itself at a chosen step.

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
