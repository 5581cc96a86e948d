"""A sampler thread for benchmarks: ``sample()`` every ``every_s`` seconds while a ``with`` block
runs (``run_queue.RunQueueSampler``, ``benchmarks/big_data.py``'s memory and disk samplers).

A period counts from one sample's start to the next, so a slow sample does not stretch the
series; a sample that raises is handed to ``sample_failed`` (by default dropped: a process gone
mid-read is the usual cause, and the next sample counts) and never ends the thread.
"""
from __future__ import annotations

import threading
import time
from typing import Any


class PeriodicSampler:
    """Subclasses define ``sample``; ``with Sub(...) as s:`` samples until the block ends."""

    def __init__(self, every_s: float, name: str, join_timeout_s: float = 30.0) -> None:
        self.every_s, self.join_timeout_s = every_s, join_timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Any:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=self.join_timeout_s)

    def sample(self) -> None:
        raise NotImplementedError

    def sample_failed(self, exc: Exception) -> None:
        """A sample raised ``exc``; dropped unless a subclass reports it."""

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - a failed sample never ends the sampling
                self.sample_failed(exc)
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - started)))
