"""What a training role tells its supervisor: its exit code, and structured events in its log.

**Exit codes** (``EXIT_*``): a role's process exit code says whether a retry can help
(``DETERMINISTIC_EXIT_CODES`` cannot). ``training.launch.job`` re-exports them beside the job spec.

**Events**: a worker writes one event line per fact a reader needs: a worker started (its kvstore
rank), the first step of a fresh start, progress, an epoch done (with its record), a checkpoint
committed, a resume, the first step after a resume; and any role on a spot instance, the
interruption notice of its instance (``common.procs.spot``). An event line is ``EVENT_MARK``
followed by one JSON object (a model below, ``kind`` naming it, ``v`` the format's version),
written by ``emit`` through logging, so it carries the logging prefix like any line. Readers (the
status record, live MLflow tracking, the recovery timeline and goodput) get events from lines with
``parse_event`` only: rewording a human log line changes nothing they compute, and the human
lines stay free to say things for people.

Why the event lines stay in the one log stream (and so in the job log a user reads) rather than a
channel of their own: a role's stdout is the only channel from a role on any host (local, SSH,
EC2) to its supervisor, and in that stream an event keeps its order relative to the human lines
around it (a timeline needs both). They are rare (a progress event every few seconds, the rest per
epoch, checkpoint or attempt) and start with a fixed mark, so a reader of the log can skip them
(``grep -v '@event '``) and any saved log (an events file, an Airflow task log) replays through
the same parser.

Nothing here imports MXNet or MLflow: roles, the supervisor and offline readers all use it.
"""
from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = ["DETERMINISTIC_EXIT_CODES", "EVENT_MARK", "EXIT_BAD_INPUT", "EXIT_NAN_LOSS", "EXIT_OK", "EXIT_PREEMPTED",
           "CheckpointCommitted", "EpochDone", "Event", "EventError", "FirstStep", "FirstStepAfterResume", "Progress",
           "Resumed", "SpotInterruption", "WorkerStarted", "emit", "event_line", "parse_event"]

# -- exit codes -----------------------------------------------------------------------------------

# Role exit codes. A deterministic failure is not worth a retry; anything else may be.
EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_NAN_LOSS = 3
# SIGTERM (preemption): rank 0 wrote an emergency checkpoint if it could; retrying resumes.
EXIT_PREEMPTED = 75
DETERMINISTIC_EXIT_CODES = frozenset({EXIT_BAD_INPUT, EXIT_NAN_LOSS})

# -- events ---------------------------------------------------------------------------------------

EVENT_MARK = "@event "
VERSION = 1

log = logging.getLogger("events")


class EventError(ValueError):
    """A line with the event mark whose JSON is not a known event of this version."""


class _Event(BaseModel):
    # NaN stays NaN in the JSON (a diverging loss in an epoch record), not null.
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_inf_nan="constants")

    v: Literal[1] = VERSION


class WorkerStarted(_Event):
    """A worker joined the kvstore: ps-lite assigns ranks, so the role named worker-0 need not be rank 0."""

    kind: Literal["worker_started"] = "worker_started"
    rank: int
    num_workers: int


class FirstStep(_Event):
    """A fresh start's first step is computed (not only queued): the time to the first step
    (``benchmarks/many_roles.py``) is measured to it. A resumed start writes
    ``FirstStepAfterResume`` instead."""

    kind: Literal["first_step"] = "first_step"
    global_step: int


class Progress(_Event):
    """A worker's periodic progress (``training.loop.metrics.PROGRESS_EVERY_S``)."""

    kind: Literal["progress"] = "progress"
    epoch: int
    step: int  # steps done in the epoch
    steps: int  # steps per epoch
    global_step: int


class EpochDone(_Event):
    """An epoch ended; ``record`` is its history record (rank 0's holds the validation metrics).
    ``epochs``: the job's epochs; ``eta_s``: the time the remaining epochs' steps take at this
    epoch's step time (both None on lines written before they were added)."""

    kind: Literal["epoch_done"] = "epoch_done"
    epoch: int
    global_step: int
    record: dict[str, Any]
    epochs: int | None = None
    eta_s: float | None = None


class CheckpointCommitted(_Event):
    """A checkpoint's manifest landed (``training.checkpoint.store``): the step is durable."""

    kind: Literal["checkpoint_committed"] = "checkpoint_committed"
    step: int
    uri: str
    # What the save cost, as its writer measured it (None from a writer that does not say: an
    # older role's line, a store used outside the training loop). ``bytes``: the files committed.
    # ``upload_s``: serialising, hashing, putting and committing them (in the background when
    # the upload is asynchronous). ``blocked_s``: the training loop's time on this save (the
    # snapshot, a wait for the previous upload, and the whole upload when it is synchronous):
    # what P2 divides by the loop's wall time.
    bytes: int | None = None
    upload_s: float | None = None
    blocked_s: float | None = None


class Resumed(_Event):
    """A worker restored a checkpoint and continues from its ``step``."""

    kind: Literal["resumed"] = "resumed"
    step: int
    epoch: int
    step_in_epoch: int


class FirstStepAfterResume(_Event):
    """The first step after a resume is computed (not only queued): recovery is measured to it."""

    kind: Literal["first_step_after_resume"] = "first_step_after_resume"
    global_step: int
    resumed_from: int


class SpotInterruption(_Event):
    """The instance a role runs on got EC2's spot interruption notice (``common.procs.spot``): it
    is reclaimed at ``time`` (about two minutes after the notice). Every watching role of the
    instance writes it once, so a reader keys it by ``instance_id``."""

    kind: Literal["spot_interruption"] = "spot_interruption"
    instance_id: str
    action: Literal["terminate", "stop", "hibernate"]
    time: str  # as the metadata service gives it (ISO 8601, UTC: "2026-12-06T20:07:00Z")
    host: str  # the role's node host (DMLC_NODE_HOST: what the supervisor's handle calls it)


Event = Annotated[WorkerStarted | FirstStep | Progress | EpochDone | CheckpointCommitted | Resumed
                  | FirstStepAfterResume | SpotInterruption, Field(discriminator="kind")]
_EVENT: TypeAdapter[Event] = TypeAdapter(Event)


def event_line(event: _Event) -> str:
    """The text of ``event``'s line (without the logging prefix ``emit`` adds)."""
    return EVENT_MARK + event.model_dump_json()


def emit(event: _Event) -> None:
    """Write ``event`` as one line of this process's log."""
    log.info("%s", event_line(event))


def parse_event(line: str) -> Event | None:
    """The event a log line carries (anywhere after a prefix: logging's, the supervisor's relay),
    or None for a line without the event mark. Raises ``EventError`` for a marked line that is not
    a valid event."""
    at = line.find(EVENT_MARK)
    if at < 0:
        return None
    try:
        return _EVENT.validate_json(line[at + len(EVENT_MARK):])
    except ValidationError as exc:
        raise EventError(f"malformed event line {line[at:][:300]!r}: {exc}") from None
