"""The training job's log in storage: the supervisor ships it while the job runs, any reader on any
host reads it from there (never from the supervisor host's disk).

**Where**: ``{folder of the job's status record}/job_logs/{job_id}/`` (``log_prefix``), beside the
status record and the job document, a folder per job (each attempt's supervisor has its own id).

**How**: append-only chunks ``00000000.log``, ``00000001.log``, … each a run of whole lines,
written once. S3 has no append on a general-purpose bucket (an object is replaced whole, and
only S3 Express directory buckets, which SeaweedFS does not offer, append), so the choice was
between rewriting one object and adding objects. Rewriting a growing object makes each write cost
the whole log so far; rewriting a bounded one (its tail) loses what scrolled out of it. Chunks
keep every line, each PUT carries only the new lines, and a reader's position is one integer
(the next chunk's number): a reader that keeps it neither repeats nor loses a line, and a
chunk that is not there yet is a plain 404 (nothing new), so a poll is one GET.

**Bounds** (``LogShipper``): at most one PUT per ``FLUSH_S`` while there are new lines (none
while the job is quiet), a chunk at most ``MAX_CHUNK_BYTES``, a buffer at most
``MAX_BUFFER_BYTES``: while storage cannot be written, the oldest unshipped lines are dropped
beyond it and the next chunk says how many. A chunk whose PUT failed is kept as it was and sent
again under the same number (a PUT that landed but answered late is replaced by the same bytes).
``close`` ships the rest: the supervisor closes it in a ``finally``, so the last lines of a
failed job arrive too (a SIGKILL of the supervisor loses at most its last ``FLUSH_S``).

**Reading** (``read_new``): the chunks from a position on, at most ``MAX_CHUNKS_PER_READ`` per
call, so a reader catching up on a long job (from chunk 0) stays a bounded poll.
``relay_line`` turns a shipped line into what a person reads in a task log: a role's
``EpochDone`` event (``common.events``) becomes the epoch's line (loss, the validation metrics,
throughput, ETA) from its typed fields; the other event lines, which repeat human lines beside
them, are left out.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from common import storage
from common.events import EVENT_MARK, EpochDone, EventError, parse_event

__all__ = ["FLUSH_S", "LOG_FORMAT", "LogShipper", "chunk_uri", "log_prefix", "read_new", "relay_line",
           "storage_get"]

# What the supervisor's own log lines look like (``python -m training``'s logging format).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Lines reach a reader within this (plus its own poll): 0.5 PUT/s per running job at most.
FLUSH_S = 2.0
MAX_CHUNK_BYTES = 256 * 1024
MAX_BUFFER_BYTES = 4 * 1024 * 1024
MAX_CHUNKS_PER_READ = 50
CLOSE_ATTEMPTS = 3
CHUNK_DIGITS = 8

Getter = Callable[[str], "bytes | None"]
Putter = Callable[[str, bytes], Any]


def log_prefix(status_uri: str, job_id: str) -> str:
    """The folder of job ``job_id``'s log chunks, beside its status record."""
    from common.paths import safe_component

    folder = status_uri.rstrip("/").rsplit("/", 1)[0]
    return storage.join(folder, "job_logs", safe_component(job_id))


def chunk_uri(prefix: str, seq: int) -> str:
    return storage.join(prefix, f"{seq:0{CHUNK_DIGITS}d}.log")


def storage_get(uri: str) -> bytes | None:
    """``common.storage``'s read (this process's credentials); None where there is no object."""
    try:
        return storage.get_bytes(uri)
    except FileNotFoundError:
        return None


def read_new(prefix: str, seq: int, get: Getter = storage_get,
             max_chunks: int = MAX_CHUNKS_PER_READ) -> tuple[list[str], int]:
    """The lines of the chunks from number ``seq`` on (at most ``max_chunks`` of them) and the
    number of the next chunk to read. Raises what ``get`` raises (storage trouble): the caller
    reads again from the same ``seq``."""
    lines: list[str] = []
    for _ in range(max_chunks):
        data = get(chunk_uri(prefix, seq))
        if data is None:
            break
        lines += data.decode("utf-8", errors="replace").splitlines()
        seq += 1
    return lines, seq


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def epoch_line(event: EpochDone) -> str:
    """The line a person reads for one epoch: from the event's typed fields, not from log text."""
    r = event.record
    of = f"/{event.epochs}" if event.epochs else ""
    parts = [f"epoch {event.epoch + 1}{of} done at global step {event.global_step}"]
    if "train_loss" in r:
        parts.append(f"loss {float(r['train_loss']):.4f}")
    parts += [f"{k} {float(v):.4f}" for k, v in sorted(r.items())
              if k.startswith("val_") and isinstance(v, (int, float))]
    if "samples_per_s_total" in r:
        parts.append(f"{float(r['samples_per_s_total']):.0f} samples/s")
    parts.append(f"ETA {_eta(event.eta_s)}")
    return ", ".join(parts)


def relay_line(line: str) -> str | None:
    """What a task log shows for one shipped line: the line itself; a role's epoch event as its
    epoch line (after the line's own prefix: time, role); None for any other event line."""
    try:
        event = parse_event(line)
    except EventError:
        return line  # a malformed event line is still something a person may need to see
    if event is None:
        return line
    if isinstance(event, EpochDone):
        return line[:line.find(EVENT_MARK)] + epoch_line(event)
    return None


class LogShipper(logging.Handler):
    """A logging handler that ships the lines it gets to ``prefix`` as chunks (see the module
    docstring), from a thread of its own; ``close`` ships what is left."""

    def __init__(self, prefix: str, *, put: Putter = storage.put_bytes, flush_s: float = FLUSH_S,
                 max_chunk_bytes: int = MAX_CHUNK_BYTES, max_buffer_bytes: int = MAX_BUFFER_BYTES) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.prefix, self.put, self.flush_s = prefix, put, flush_s
        self.max_chunk_bytes, self.max_buffer_bytes = max_chunk_bytes, max_buffer_bytes
        self.seq = 0  # the next chunk's number
        self.dropped = 0  # lines dropped since the last chunk (storage down, buffer full)
        self._lines: deque[bytes] = deque()
        self._bytes = 0
        self._pending: bytes | None = None  # a chunk whose PUT has not succeeded yet
        self._buffer_lock = threading.Lock()
        self._ship_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="job-log-shipper", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode("utf-8", errors="replace")
        except Exception:  # noqa: BLE001 - logging's rule: a bad record never breaks the caller
            self.handleError(record)
            return
        data = data[:self.max_chunk_bytes]
        with self._buffer_lock:
            self._lines.append(data)
            self._bytes += len(data)
            while self._bytes > self.max_buffer_bytes and len(self._lines) > 1:
                self._bytes -= len(self._lines.popleft())
                self.dropped += 1
            full = self._bytes >= self.max_chunk_bytes
        if full:
            self._wake.set()

    def _next_chunk(self) -> bytes | None:
        with self._buffer_lock:
            if not self._lines:
                return None
            out: list[bytes] = []
            if self.dropped:
                out.append(f"[job log: {self.dropped} line(s) dropped while storage could not be written]\n"
                           .encode())
                self.dropped = 0
            size = sum(map(len, out))
            while self._lines and (not out or size + len(self._lines[0]) <= self.max_chunk_bytes):
                line = self._lines.popleft()
                self._bytes -= len(line)
                size += len(line)
                out.append(line)
            return b"".join(out)

    def ship(self) -> bool:
        """Write the buffered lines as chunks now; False if a PUT failed (the chunk is kept)."""
        with self._ship_lock:
            while True:
                if self._pending is None:
                    self._pending = self._next_chunk()
                if self._pending is None:
                    return True
                try:
                    self.put(chunk_uri(self.prefix, self.seq), self._pending)
                except Exception:  # noqa: BLE001 - storage trouble: the same chunk goes again next time
                    return False
                self.seq += 1
                self._pending = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_s)
            self._wake.clear()
            self.ship()

    def close(self) -> None:
        """Stop the thread and ship the rest (a few attempts: the job is ending either way)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=60)
        for _ in range(CLOSE_ATTEMPTS):
            if self.ship():
                break
        super().close()
