"""Batches prepared ahead of the step, in a background thread, in the order they were given.

The step loop asks for ``(step, idx)`` batches from ``training.feed.data.EpochOrder`` and needs each
one as device arrays (what ``StepRunner.load`` builds: the rows gathered from the mapped shards,
split over the worker's contexts, per micro-batch). Done inline, that gather and copy sit
between two steps; here a thread does it ``depth`` batches ahead, so the step only waits when
the reader is slower than training.

Why a thread (not a process or a DataLoader): the work is a numpy gather (which releases the
GIL while it copies) and ``mx.nd.array``, whose copy runs in MXNet's engine; a thread shares the
mapped shards and the contexts with no pickling. Creating CPU NDArrays from a second Python
thread is safe in MXNet 1.9: autograd's recording flag is per thread (the producer's copies are
never recorded into the step's graph) and the engine takes pushes from any thread; the unit
tests train through the thread and compare the parameters bit for bit with the inline feed.

What ``depth`` means (``data.prefetch_batches``): the most batches prepared and not yet taken;
the thread blocks when the queue is full, so memory is bounded by ``depth + 1`` batches. 0 means
no thread: each batch is built inline when the loop asks for it (the old behaviour, for
debugging and for measuring what prefetching saves).

Determinism: one producer walks the given batches in order into a FIFO queue, and loading
draws no random numbers, so the loop sees exactly the inline sequence at any depth; a resumed
job that starts mid-epoch gets the same batches as an uninterrupted one.

Every wait is bounded (docs/architecture.md, "Every wait is bounded"): the loop waits at most
``wait_s`` for a batch and polls the thread's health meanwhile; the thread's puts time out and
re-check a stop flag. An exception while loading is re-raised in the loop as ``PrefetchError``
naming the step. The thread ends at the epoch's end, and when the loop stops early (a break,
an exception, the generator closed); it is a daemon, so a worker leaving through ``os._exit``
(preemption) is never held up by it.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long the loop waits for one batch: loading a batch from local disk takes milliseconds, so
# this only fires when the reader is stuck (a hung disk), with a message instead of a stall.
WAIT_S = 300.0
# How often a blocked put or get wakes to check the stop flag / the other side's health.
POLL_S = 0.2
# How long stopping waits for the thread to finish the batch it is loading.
JOIN_S = 30.0


class PrefetchError(RuntimeError):
    """Preparing a batch failed (or never finished); ``step`` is the step-in-epoch it was for."""

    def __init__(self, message: str, step: int | None) -> None:
        super().__init__(message)
        self.step = step


@dataclass(frozen=True)
class _Failed:
    step: int | None
    error: BaseException


_END = object()


def prefetched(batches: Iterable[tuple[int, np.ndarray]], load: Callable[[np.ndarray], T], depth: int, *,
               label: str = "", wait_s: float = WAIT_S) -> Iterator[tuple[int, np.ndarray, T]]:
    """Yields ``(step, idx, load(idx))`` for each of ``batches``, in order, ``depth`` ahead.

    ``label`` names the batches in errors and in the thread's name (e.g. ``"epoch 3"``).
    """
    if depth < 0:
        raise ValueError(f"prefetch depth must be >= 0, got {depth}")
    if depth == 0:
        for step, idx in batches:
            yield step, idx, _load(load, step, idx, label)
        return
    producer = _Producer(batches, load, depth, label)
    producer.start()
    try:
        yield from producer.take(wait_s)
    finally:
        producer.stop()


def _load(load: Callable[[np.ndarray], T], step: int, idx: np.ndarray, label: str) -> T:
    try:
        return load(idx)
    except Exception as exc:
        raise _error(step, exc, label) from exc


def _error(step: int | None, exc: BaseException, label: str) -> PrefetchError:
    where = f"step {step}" if step is not None else "the batch order"
    return PrefetchError(f"loading the batch of {where}{' of ' + label if label else ''} failed: "
                         f"{type(exc).__name__}: {exc}", step)


class _Producer(threading.Thread, Generic[T]):
    """The one thread that loads the batches of one epoch (or of what is left of it)."""

    def __init__(self, batches: Iterable[tuple[int, np.ndarray]], load: Callable[[np.ndarray], T], depth: int,
                 label: str) -> None:
        super().__init__(name=f"prefetch {label}".strip(), daemon=True)
        self._batches, self._load, self.label = batches, load, label
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stopping = threading.Event()

    def run(self) -> None:
        step = None
        try:
            for step, idx in self._batches:
                if self._stopping.is_set():
                    return
                item = (step, idx, self._load(idx))
                if not self._put(item):
                    return
        except BaseException as exc:  # handed to the loop, which raises it; nothing is lost here
            self._put(_Failed(step, exc))
            return
        self._put(_END)

    def _put(self, item: object) -> bool:
        """False when the loop stopped listening; a full queue never blocks for longer than POLL_S."""
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def take(self, wait_s: float) -> Iterator[tuple[int, np.ndarray, T]]:
        last = None
        while True:
            waiting_since = time.monotonic()
            while True:
                try:
                    item = self._queue.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    if not self.is_alive() and self._queue.empty():
                        raise PrefetchError(f"the prefetch thread of {self.label} ended after step {last} "
                                            "without a batch or an error", last) from None
                    if time.monotonic() - waiting_since > wait_s:
                        raise PrefetchError(f"no batch after step {last} of {self.label} within {wait_s:.0f} s "
                                            "(the shard reader is stuck)", last) from None
            if item is _END:
                self.join(JOIN_S)
                return
            if isinstance(item, _Failed):
                raise _error(item.step, item.error, self.label) from item.error
            last = item[0]  # type: ignore[index]
            yield item  # type: ignore[misc]

    def stop(self) -> None:
        """Ask the thread to stop, drop what it prepared, and wait (bounded) for it to end."""
        self._stopping.set()
        while True:  # frees the prepared batches now, not when the generator is collected
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self.join(JOIN_S)
        if self.is_alive():
            log.warning("prefetch thread of %s still loading after %.0f s; it is a daemon and ends with the "
                        "process", self.label, JOIN_S)
