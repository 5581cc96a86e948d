"""Write checkpoints from a background thread, at most one in flight.

The training loop hands over a ``Snapshot`` (host copies, already taken); serialisation,
encryption, upload and pruning happen here. Policy when the next checkpoint is due while the
previous one is still uploading: a periodic one is **skipped** (counted in ``skipped``; the
next due one is taken instead), one that must exist (epoch end, final, emergency) **waits**
(counted in ``waited``, with the time blocked). A failed upload is retried with exponential
backoff (1, 2, 4 … 30 s) until ``upload_timeout_s``; if it still fails, the checkpoint is given
up (counted in ``failed``, logged) and training goes on: an older committed one still stands.
``close()`` waits for the pending upload before the job exits.

``nice`` > 0 lowers the background writer's CPU priority (Linux schedules every thread as a
task; the threads it starts, the sha256 helper and boto3's multipart workers, inherit it). Off
by default, because measured it does not make a save cheaper: with the S3 server on the same
two cores, a nice-19 writer cost as many steps per committed save as a normal one (2.9 vs 3.0)
and, starved of CPU, got only half of its periodic checkpoints committed (benchmarks/README.md).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from training.checkpoint.store import CheckpointStore
from training.checkpoint.state import Snapshot

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0


@dataclass
class CheckpointStats:
    committed: int = 0
    skipped: int = 0
    waited: int = 0
    failed: int = 0
    retries: int = 0
    blocked_s: float = 0.0  # time the training loop spent on checkpoints (snapshot + waits)
    upload_s: float = 0.0   # time spent serialising and uploading (background when async)
    bytes: int = 0
    steps: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "steps"} | {"last_step": self.steps[-1:] or None}


class Checkpointer:
    """Synchronous or asynchronous writer of snapshots into a ``CheckpointStore``."""

    def __init__(self, store: CheckpointStore, *, asynchronous: bool = True, upload_timeout_s: float = 300.0,
                 nice: int = 0) -> None:
        self.store = store
        self.asynchronous = asynchronous
        self.upload_timeout_s = upload_timeout_s
        self.nice = nice
        self.stats = CheckpointStats()
        self._thread: threading.Thread | None = None
        self._last_error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, snap: Snapshot, *, must: bool, deadline: float | None = None) -> bool:
        """Write ``snap``; returns False if it was skipped because one is still in flight."""
        if self.busy:
            if not must:
                self.stats.skipped += 1
                log.info("checkpoint at step %d skipped: the previous one is still uploading", snap.step)
                return False
            self.stats.waited += 1
            started = time.monotonic()
            self.wait(deadline)
            self.stats.blocked_s += time.monotonic() - started
        if not self.asynchronous:
            started = time.monotonic()
            self._write(snap, deadline)
            self.stats.blocked_s += time.monotonic() - started
            return True
        self._thread = threading.Thread(target=self._write_nice, args=(snap, deadline), name=f"ckpt-{snap.step}",
                                        daemon=True)
        self._thread.start()
        return True

    def wait(self, deadline: float | None = None) -> bool:
        """Wait for the upload in flight (until ``deadline``, monotonic); True if none is left."""
        if self._thread is None:
            return True
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self, deadline: float | None = None) -> None:
        if not self.wait(deadline):
            log.error("checkpoint upload still running at exit; the newest committed checkpoint stands")
        log.info("checkpoint stats: %s", self.stats.as_dict())

    def _write_nice(self, snap: Snapshot, deadline: float | None) -> None:
        """The background thread: lower its own priority (never the training thread's), then write."""
        if self.nice:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (OSError, AttributeError):  # not Linux, or not allowed: write at normal priority
                log.debug("cannot lower the checkpoint writer's priority", exc_info=True)
        self._write(snap, deadline)

    def _write(self, snap: Snapshot, deadline: float | None) -> None:
        started = time.monotonic()
        give_up = started + self.upload_timeout_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        delay = BACKOFF_FIRST_S
        try:
            files = snap.files()
        except Exception as exc:  # noqa: BLE001 - a bug here must not kill training silently either
            log.exception("cannot serialise checkpoint at step %d", snap.step)
            self.stats.failed += 1
            self._last_error = exc
            return
        while True:
            try:
                self.store.save(snap.step, files, snap.state)
                self.stats.committed += 1
                self.stats.bytes += sum(len(d) for d in files.values())
                self.stats.steps.append(snap.step)
                break
            except Exception as exc:  # noqa: BLE001 - S3 errors of every kind are retried, bounded
                if isinstance(exc, ValueError) or time.monotonic() + delay > give_up:
                    log.error("checkpoint at step %d not written (%s: %s); an older committed one stands",
                              snap.step, type(exc).__name__, exc)
                    self.stats.failed += 1
                    self._last_error = exc
                    break
                self.stats.retries += 1
                log.warning("checkpoint upload at step %d failed (%s: %s); retrying in %.0fs",
                            snap.step, type(exc).__name__, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
        self.stats.upload_s += time.monotonic() - started
