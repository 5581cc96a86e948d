"""Upload checkpoints from a background thread, at most one in flight.

The training loop's checkpoint manager (``training.checkpoint.manager``: cadence, skipping a
periodic save while one is in flight, emergency save, statistics) hands over a ``Snapshot``
(host copies, already taken); serialisation, encryption, upload and pruning happen here. A
snapshot submitted while the previous one is still uploading **waits** for it (counted in
``waited``). A failed upload is retried with exponential backoff (1, 2, 4 … 30 s) until
``upload_timeout_s``; each attempt's S3 requests fail fast (``common.storage.fail_fast``: no
botocore backoff of its own that could silently outlast an outage, so every failure is seen,
logged and counted here); if it still fails, the checkpoint is given up (counted in ``failed``,
logged) and training goes on: an older committed one still stands. ``close()`` waits for the
pending upload before the job exits.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from common import storage
from training.checkpoint.store import CheckpointStore, SaveTiming
from training.checkpoint.state import Snapshot

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0


@dataclass
class CheckpointStats:
    """What happened to a job's checkpoints. The uploader counts the uploads (committed, waited,
    failed, retries, upload_s, bytes, steps); the manager what the loop paid (skipped, blocked_s)."""

    committed: int = 0
    skipped: int = 0
    waited: int = 0
    failed: int = 0
    retries: int = 0
    blocked_s: float = 0.0  # time the training loop spent on checkpoints (snapshot, waits, a sync write)
    upload_s: float = 0.0   # time spent serialising and uploading (background when async)
    bytes: int = 0
    steps: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "steps"} | {"last_step": self.steps[-1:] or None}


class CheckpointUploader:
    """Writes snapshots into a ``CheckpointStore``: serialised, encrypted and uploaded in a
    background thread (``asynchronous``) or in the caller's."""

    def __init__(self, store: CheckpointStore, *, asynchronous: bool = True, upload_timeout_s: float = 300.0) -> None:
        self.store = store
        self.asynchronous = asynchronous
        self.upload_timeout_s = upload_timeout_s
        self.stats = CheckpointStats()
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, snap: Snapshot, *, deadline: float | None = None, blocked_since: float | None = None) -> None:
        """Write ``snap`` (in the background when asynchronous), after the upload in flight if any.
        ``blocked_since``: when the loop began this save (before its snapshot; default now), for
        the blocked time its commit event reports."""
        blocked_since = time.monotonic() if blocked_since is None else blocked_since
        if self.busy:
            self.stats.waited += 1
            self.wait(deadline)
        if not self.asynchronous:
            self._write(snap, deadline, SaveTiming(began=time.monotonic(), blocked_since=blocked_since))
            return
        began = time.monotonic()  # the loop goes on from here
        timing = SaveTiming(began=began, blocked_s=began - blocked_since)
        self._thread = threading.Thread(target=self._write, args=(snap, deadline, timing), name=f"ckpt-{snap.step}",
                                        daemon=True)
        self._thread.start()

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

    def _write(self, snap: Snapshot, deadline: float | None, timing: SaveTiming) -> None:
        started = time.monotonic()
        give_up = started + self.upload_timeout_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        delay = BACKOFF_FIRST_S
        try:
            files = snap.files()
        except Exception:  # noqa: BLE001 - a bug here must not kill training silently either
            log.exception("cannot serialise checkpoint at step %d", snap.step)
            self.stats.failed += 1
            return
        while True:
            try:
                with storage.fail_fast():
                    self.store.save(snap.step, files, snap.state, timing=timing)
                self.stats.committed += 1
                self.stats.bytes += sum(len(d) for d in files.values())
                self.stats.steps.append(snap.step)
                break
            except Exception as exc:  # noqa: BLE001 - S3 errors of every kind are retried, bounded
                if isinstance(exc, ValueError) or time.monotonic() + delay > give_up:
                    log.error("checkpoint at step %d not written (%s: %s); an older committed one stands",
                              snap.step, type(exc).__name__, exc)
                    self.stats.failed += 1
                    break
                self.stats.retries += 1
                log.warning("checkpoint upload at step %d failed (%s: %s); retrying in %.0fs",
                            snap.step, type(exc).__name__, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
        self.stats.upload_s += time.monotonic() - started
