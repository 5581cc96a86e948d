"""Preemption: SIGTERM asks a worker to stop; it does so between steps, with an emergency checkpoint.

The signal handler only records when the notice came (``Preemption.requested_at``); the loop
checks ``requested`` after every step, where the state is consistent, and calls ``exit``: rank 0
writes an emergency checkpoint within the grace period (``training.checkpoint.manager``), then
every worker exits with ``EXIT_PREEMPTED``, which the supervisor treats as retryable.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any, NoReturn

from common.events import EXIT_PREEMPTED
from training.checkpoint.manager import CheckpointManager

__all__ = ["Preemption"]


class Preemption:
    """SIGTERM sets a flag; the loop acts on it between steps, where the state is consistent."""

    def __init__(self) -> None:
        self.requested_at: float | None = None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    @classmethod
    def install(cls) -> "Preemption":
        flag = cls()

        def on_term(signum: int, frame: Any) -> None:
            if flag.requested_at is None:
                flag.requested_at = time.monotonic()

        signal.signal(signal.SIGTERM, on_term)
        return flag

    def exit(self, ckpts: CheckpointManager, global_step: int, *, save: bool) -> NoReturn:
        """Rank 0 writes an emergency checkpoint within the grace period (``ckpts.emergency``;
        ``save=False`` when this step's epoch-end one was just submitted); every rank exits 75.

        A non-zero rank can only exit: ps-lite cannot lose a worker, so rank 0 and the others block
        in their next step until the supervisor sees the exit code and stops the job; the retry
        resumes from the newest committed checkpoint (at most one cadence interval old).
        """
        assert self.requested_at is not None
        ckpts.emergency(global_step, self.requested_at, save=save)
        # os._exit, not SystemExit: the kvstore's destructor would wait in a ps-lite barrier for
        # workers that never reach it.
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # a broken pipe: the supervisor that read it is gone (common.procs.watchdog)
        os._exit(EXIT_PREEMPTED)
