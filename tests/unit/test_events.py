"""The role events of ``common.events``: one line each, read back through ``parse_event`` only."""
import logging
import math

import pytest

from common.events import (EVENT_MARK, CheckpointCommitted, EpochDone, EventError, FirstStep, FirstStepAfterResume,
                           Progress, Resumed, SpotInterruption, WorkerStarted, emit, event_line, parse_event)

pytestmark = pytest.mark.unit

EVENTS = [WorkerStarted(rank=1, num_workers=2), FirstStep(global_step=1), Progress(epoch=0, step=5, steps=19, global_step=5),
          EpochDone(epoch=1, global_step=38, record={"epoch": 1, "train_loss": 0.25, "val_accuracy": 0.9}),
          CheckpointCommitted(step=28, uri="s3://b/ckpt/step-00000028/abc"),
          Resumed(step=28, epoch=1, step_in_epoch=9), FirstStepAfterResume(global_step=29, resumed_from=28),
          SpotInterruption(instance_id="i-0abc", action="terminate", time="2026-12-06T20:07:00Z", host="10.0.0.5")]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.kind)
def test_an_event_line_reads_back_as_the_same_event_behind_any_prefix(event):
    line = event_line(event)
    assert line.startswith(EVENT_MARK) and "\n" not in line
    assert parse_event(line) == event
    # Behind the logging prefix of a role, and the supervisor's relay of it.
    assert parse_event(f"[worker-0@10.0.0.5] 2026-01-01 12:00:00,000 INFO events: {line}") == event


def test_emit_writes_one_log_line_of_the_event(caplog):
    caplog.set_level(logging.INFO, logger="events")
    emit(EVENTS[1])
    (record,) = caplog.records
    assert parse_event(record.getMessage()) == EVENTS[1]


def test_a_diverged_loss_stays_nan_in_an_epoch_record():
    got = parse_event(event_line(EpochDone(epoch=0, global_step=3, record={"train_loss": float("nan")})))
    assert math.isnan(got.record["train_loss"])


def test_human_lines_are_no_events():
    assert parse_event("progress epoch=0 step=5/19 global_step=5 loss=1.0") is None
    assert parse_event("checkpoint committed: step 28 at s3://b/ckpt/step-00000028/abc") is None


@pytest.mark.parametrize("text, problem", [
    ('{"v": 1, "kind": "progress", "epoch": 0}', "steps"),  # a field missing
    ('{"v": 1, "kind": "exploded"}', "exploded"),  # an unknown kind
    ('{"v": 2, "kind": "worker_started", "rank": 0, "num_workers": 1}', "v"),  # a newer format
    ('{"v": 1, "kind": "worker_started", "rank": 0, "num_workers": 1, "extra": 1}', "extra"),
    ('{"v": 1, "kind": "progress", "epoch": 0, ', "EOF"),  # a torn line
    # an action EC2 does not send
    ('{"v": 1, "kind": "spot_interruption", "instance_id": "i-1", "action": "reboot", "time": "t", "host": "h"}',
     "action"),
])
def test_a_malformed_event_line_is_an_error_naming_it(text, problem):
    with pytest.raises(EventError, match="malformed event line") as err:
        parse_event("INFO events: " + EVENT_MARK + text)
    assert problem in str(err.value)
