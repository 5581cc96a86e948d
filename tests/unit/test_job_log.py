"""The job log shipper (``common.job_log``): whole-line chunks written once, a reader's position
that neither repeats nor loses a line, bounded memory while storage is down, the rest shipped on
close; and the epoch line a task log shows for a role's typed ``EpochDone`` event."""
from __future__ import annotations

import logging
import os
import uuid

import pytest

from common import storage
from common.events import EpochDone, Progress, event_line
from common.job_log import LogShipper, chunk_uri, log_prefix, read_new, relay_line
from testkit.waits import wait_for

NEVER = 3600.0  # a flush interval that never passes within a test: only ship()/close() write


def _logger(shipper: LogShipper) -> logging.Logger:
    logger = logging.getLogger(f"test-job-log-{uuid.uuid4().hex}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(shipper)
    return logger


def _messages(lines: list[str]) -> list[str]:
    return [ln.split(": ", 1)[1] for ln in lines]


@pytest.mark.unit
def test_log_prefix_sits_beside_the_status_record():
    assert (log_prefix("s3://b/root/dag/run/config/job_status.json", "2-abc")
            == "s3://b/root/dag/run/config/job_logs/2-abc")


@pytest.mark.unit
def test_chunks_hold_whole_lines_and_a_reader_resumes_from_its_position(tmp_path):
    prefix = str(tmp_path / "job_logs" / "1-a")
    shipper = LogShipper(prefix, flush_s=NEVER, max_chunk_bytes=300)
    logger = _logger(shipper)
    for i in range(40):
        logger.info("line %03d %s", i, "x" * 20)
    assert shipper.ship() and shipper.seq > 3
    sizes = [os.path.getsize(chunk_uri(prefix, s)) for s in range(shipper.seq)]
    assert max(sizes) <= 300
    first, seq = read_new(prefix, 0, max_chunks=3)  # a bounded read: three chunks
    assert seq == 3
    for i in range(40, 50):  # lines logged after the first read
        logger.info("line %03d %s", i, "x" * 20)
    shipper.close()
    rest, end = read_new(prefix, seq)
    assert end == shipper.seq and read_new(prefix, end) == ([], end)  # nothing more: a 404, not an error
    assert _messages(first + rest) == [f"line {i:03d} {'x' * 20}" for i in range(50)]


@pytest.mark.unit
def test_a_failed_put_is_sent_again_under_its_number_and_the_buffer_stays_bounded(tmp_path):
    prefix = str(tmp_path / "job_logs" / "1-b")
    down = {"on": True}
    puts: list[str] = []

    def put(uri: str, data: bytes) -> None:
        puts.append(uri)
        if down["on"]:
            raise ConnectionError("storage down")
        storage.put_bytes(uri, data)

    shipper = LogShipper(prefix, put=put, flush_s=NEVER, max_chunk_bytes=200, max_buffer_bytes=1000)
    logger = _logger(shipper)
    logger.info("kept in the failed chunk")
    assert not shipper.ship()
    for i in range(100):  # far more than the buffer holds
        logger.info("while down %03d", i)
    assert not shipper.ship()
    assert set(puts) == {chunk_uri(prefix, 0)}  # the same chunk, again
    assert shipper._bytes <= 1000  # the oldest unshipped lines went
    down["on"] = False
    shipper.close()
    lines, _ = read_new(prefix, 0)
    assert _messages(lines[:1]) == ["kept in the failed chunk"]
    assert "line(s) dropped while storage could not be written" in lines[1]
    assert _messages(lines[-1:]) == ["while down 099"]
    assert len(lines) < 100


@pytest.mark.unit
def test_close_ships_the_last_lines(tmp_path):
    prefix = str(tmp_path / "job_logs" / "1-c")
    shipper = LogShipper(prefix, flush_s=NEVER)
    logger = _logger(shipper)
    logger.error("the last words of a failed job")
    assert read_new(prefix, 0) == ([], 0)  # not yet: no flush interval passed
    shipper.close()
    lines, _ = read_new(prefix, 0)
    assert _messages(lines) == ["the last words of a failed job"]


@pytest.mark.unit
def test_an_epoch_event_becomes_its_epoch_line_and_other_events_are_left_out():
    record = {"epoch": 1, "train_loss": 0.123456, "val_accuracy": 0.9, "samples_per_s_total": 5120.4,
              "step_time_s": 0.01}
    prefix = "2026-12-07 00:00:00,000 INFO training.launch.launcher: [worker-0@h] t INFO events: "
    line = prefix + event_line(EpochDone(epoch=1, global_step=76, record=record, epochs=3, eta_s=75.0))
    assert relay_line(line) == (prefix + "epoch 2/3 done at global step 76, loss 0.1235, val_accuracy 0.9000, "
                                "5120 samples/s, ETA 1m15s")
    assert relay_line(prefix + event_line(Progress(epoch=0, step=1, steps=2, global_step=1))) is None
    assert relay_line("a person's line") == "a person's line"


@pytest.mark.integration
def test_the_shipper_writes_to_s3_while_running_and_the_rest_on_close(s3_prefix):
    prefix = log_prefix(f"{s3_prefix}/config/job_status.json", "1-s3")
    shipper = LogShipper(prefix, flush_s=0.2)
    logger = _logger(shipper)
    try:
        logger.info("while running")
        got: list[str] = []
        seq = 0

        def more() -> bool:
            nonlocal seq
            lines, seq = read_new(prefix, seq)
            got.extend(lines)
            return bool(got)

        wait_for(more, timeout_s=30, poll_s=0.2, what="the first chunk in S3")
        logger.info("at the end")
    finally:
        shipper.close()
    rest, _ = read_new(prefix, seq)
    assert _messages(got + rest) == ["while running", "at the end"]
    assert storage.exists(chunk_uri(prefix, 0))
