"""The training loop's checkpoint policy: when to save, what a save may skip, what it cost.

Rank 0 is the only writer of checkpoints. Every worker has a ``CheckpointManager`` and the loop
calls the same methods on every rank; on the others (``rank`` != 0) it has no uploader: ``save``,
``emergency`` and ``finish`` do nothing but ``emergency``'s log line, while ``due`` answers as on
rank 0. That is on purpose: the loop reads its step losses back (a sync) where a checkpoint is
due, on every worker, so a non-zero rank never runs far ahead of rank 0's saves, and the steps
at which the tests and chaos runs inject faults keep their meaning relative to them.

- Cadence (``due``): every ``every_n_steps`` global steps and, with ``every_n_seconds`` > 0, once
  that long has passed since the last save. Never at the last step of an epoch: the epoch-end
  checkpoint follows it (the loop saves that one with ``must=True``). With ``every_n_steps:
  "auto"`` the interval is ``training.checkpoint.cadence``'s (Young/Daly from rank 0's measured
  checkpoint cost and step time between periodic saves, re-planned on drift). Only rank 0 measures a cost, so the other
  ranks keep the first interval (``cadence.BOOTSTRAP_STEPS``): their ``due`` only decides where
  they read their losses back, which changes neither the parameters nor the synchronisation
  (``dist_sync`` already meets at every step's push/pull), so an exact resume stays exact.
- A periodic save due while the previous one is still uploading is **skipped** (counted in
  ``skipped``, logged; the next due one is taken instead); one that must exist (epoch end,
  emergency) **waits** for it (``training.checkpoint.uploader``). The skip is decided before the
  snapshot, so a skipped save costs the loop nothing.
- Statistics: the uploader's ``CheckpointStats`` plus what the loop paid, ``blocked_s`` (snapshot,
  waits for the upload in flight, a synchronous write, the final wait at ``finish``).
- SIGTERM (``emergency``): a checkpoint of the current step written and committed within
  ``preempt_grace_s`` of the signal (the caller then exits).
- ``finish``: waits for the last upload and fails the job if its final checkpoint was not
  committed (unless it resumed at that step and trained nothing).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from common.config import CheckpointConfig
from training.checkpoint.cadence import AutoCadence
from training.checkpoint.state import Snapshot
from training.checkpoint.store import CheckpointStore
from training.checkpoint.uploader import CheckpointStats, CheckpointUploader

__all__ = ["CheckpointManager"]

log = logging.getLogger(__name__)


class CheckpointManager:
    """One worker's checkpoints. ``snapshot(global_step)`` takes the copy a save writes (rank 0)."""

    def __init__(self, store: CheckpointStore, cfg: CheckpointConfig, steps_per_epoch: int,
                 snapshot: Callable[[int], Snapshot], *, rank: int = 0, resumed_step: int | None = None) -> None:
        self.cfg = cfg
        self.rank = rank
        self._uploader = (CheckpointUploader(store, asynchronous=cfg.async_upload, upload_timeout_s=cfg.upload_timeout_s)
                        if rank == 0 else None)
        self.stats: CheckpointStats | None = self._uploader.stats if self._uploader is not None else None
        self._snapshot = snapshot
        self._steps_per_epoch = steps_per_epoch
        self._auto = AutoCadence(cfg.mtbf_s) if cfg.every_n_steps == "auto" else None
        self._every_n_steps = self._auto.every_n_steps if self._auto is not None else cfg.every_n_steps
        self._uploads_seen = (0, 0.0)  # the uploader's finished uploads and their seconds, at the last plan
        self._last_save_step: int | None = None
        self._every_n_seconds = cfg.every_n_seconds
        self._resumed_step = resumed_step  # a job resumed at its final step commits nothing new
        self._last_save = time.monotonic()

    def due(self, global_step: int, step_in_epoch: int, now: float) -> bool:
        """Whether a periodic checkpoint is due after ``global_step`` (``step_in_epoch`` steps of
        the epoch done; ``now`` from ``time.monotonic``). Called after every step: arithmetic only.
        Without an uploader the clock of ``every_n_seconds`` never restarts (nothing is saved), so
        once that long has passed it is due at every step, as it has always been on those ranks."""
        return ((global_step % self._every_n_steps == 0
                 or (self._every_n_seconds > 0 and now - self._last_save >= self._every_n_seconds))
                and step_in_epoch < self._steps_per_epoch)

    def save(self, global_step: int, *, must: bool, deadline: float | None = None) -> bool:
        """Snapshot and submit a checkpoint of ``global_step``; False if it was skipped.

        ``must=False`` (periodic): skipped while the previous one is still uploading. ``must=True``
        (epoch end, emergency): waits for it, until ``deadline`` (monotonic) if given.
        """
        if self._uploader is None:
            return False
        started = time.monotonic()
        if not must and self._uploader.busy:
            self.stats.skipped += 1
            log.info("checkpoint at step %d skipped: the previous one is still uploading", global_step)
            return False
        upload_s = self._upload_since_last_plan() if self._auto is not None and not self._uploader.busy else None
        # Between two periodic saves (after an epoch-end one too): steps only, engine drained at both ends.
        step_s = None
        if not must and self._last_save_step is not None and global_step > self._last_save_step:
            step_s = (started - self._last_save) / (global_step - self._last_save_step)
        self._uploader.submit(self._snapshot(global_step), deadline=deadline, blocked_since=started)
        self._last_save = time.monotonic()
        self._last_save_step = global_step
        self.stats.blocked_s += self._last_save - started
        if self._auto is not None:
            self._auto.measured(self._last_save - started, upload_s, step_s)
            self._every_n_steps = self._auto.every_n_steps
        return True

    def _upload_since_last_plan(self) -> float | None:
        """The mean duration of the uploads finished since the last call (None: none). Read only
        while no upload runs: the uploader updates its counts and seconds one after the other."""
        finished = (self.stats.committed + self.stats.failed, self.stats.upload_s)
        count, seconds = finished[0] - self._uploads_seen[0], finished[1] - self._uploads_seen[1]
        self._uploads_seen = finished
        return seconds / count if count else None

    def emergency(self, global_step: int, requested_at: float, *, save: bool) -> None:
        """SIGTERM at ``requested_at`` (monotonic): write ``global_step`` (``save``; False when the
        epoch-end checkpoint of this step was just submitted) and wait for it to commit, all
        within ``preempt_grace_s`` of the signal."""
        if self._uploader is None:
            log.warning("SIGTERM on worker %d at step %d: exiting (only rank 0 writes checkpoints)", self.rank,
                        global_step)
            return
        deadline = requested_at + self.cfg.preempt_grace_s
        log.warning("SIGTERM: writing an emergency checkpoint at step %d (grace %.0fs)", global_step,
                    self.cfg.preempt_grace_s)
        if save:
            self.save(global_step, must=True, deadline=deadline)
        self._close(deadline)
        log.warning("emergency checkpoint at step %d %s", global_step,
                    "committed" if global_step in self.stats.steps else "NOT committed within the grace period")

    def finish(self, global_step: int) -> dict[str, Any] | None:
        """Wait for the last upload; the job's checkpoint statistics (None on ranks other than 0).
        Raises if the final checkpoint (``global_step``'s) was not committed."""
        if self._uploader is None:
            return None
        self._close(None)
        if self.stats.steps[-1:] != [global_step] and global_step != self._resumed_step:
            raise RuntimeError(f"the final checkpoint (step {global_step}) was not committed; see the log above")
        if self._auto is None:
            return self.stats.as_dict()
        return self.stats.as_dict() | {"auto_every_n_steps": self._every_n_steps, "auto_replans": self._auto.replans}

    def _close(self, deadline: float | None) -> None:
        started = time.monotonic()
        self._uploader.close(deadline)
        self.stats.blocked_s += time.monotonic() - started
        log.info("checkpoint stats: %s", self.stats.as_dict())
