"""The loop's checkpoint policy (training.checkpoint.manager) over a real store in a tmp folder:
cadence, skip-while-busy, statistics, the emergency save and the final commit check."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from common.config import CheckpointConfig
from common.events import CheckpointCommitted, parse_event
from tests.unit.checkpoint_support import hold_uploads, snapshot_at
from training.checkpoint.manager import CheckpointManager
from training.checkpoint.state import Snapshot
from training.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.unit


class Snapshots:
    """The manager's ``snapshot`` callable; remembers which steps it was asked for."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def __call__(self, step: int) -> Snapshot:
        self.taken.append(step)
        return snapshot_at(step)


def test_cadence_every_n_steps_but_never_at_an_epochs_last_step(tmp_path):
    m = CheckpointManager(CheckpointStore(str(tmp_path)), CheckpointConfig(every_n_steps=10), 25, Snapshots())
    now = time.monotonic()
    # Epochs of 25 steps: global step 50 is the second epoch's last (its epoch-end save follows).
    due = [g for g in range(1, 76) if m.due(g, (g - 1) % 25 + 1, now)]
    assert due == [10, 20, 30, 40, 60, 70]


def test_cadence_every_n_seconds_counts_from_the_last_save(tmp_path):
    m = CheckpointManager(CheckpointStore(str(tmp_path)), CheckpointConfig(every_n_steps=1000, every_n_seconds=60),
                          100, Snapshots())
    now = time.monotonic()
    assert not m.due(1, 1, now)
    assert m.due(1, 1, now + 61)
    assert m.save(1, must=False)
    assert not m.due(2, 2, time.monotonic() + 30)  # the clock restarted at the save
    assert m.due(2, 2, time.monotonic() + 61)
    m.finish(1)


def test_periodic_save_is_skipped_once_while_one_uploads_and_stats_count_the_wait(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="training.checkpoint.manager")
    store = CheckpointStore(str(tmp_path), keep=5)
    gate = hold_uploads(store, monkeypatch)
    snapshots = Snapshots()
    m = CheckpointManager(store, CheckpointConfig(every_n_steps=10), 100, snapshots)
    assert m.save(10, must=False)
    assert not m.save(20, must=False)  # step 10 still uploading: skipped, no snapshot taken
    assert snapshots.taken == [10] and m.stats.skipped == 1
    assert caplog.text.count("checkpoint at step 20 skipped: the previous one is still uploading") == 1
    threading.Timer(0.3, gate.set).start()
    assert m.save(30, must=True)  # must exist: waits for step 10
    stats = m.finish(30)
    assert stats["skipped"] == 1 and stats["waited"] == 1 and stats["committed"] == 2 and stats["last_step"] == [30]
    assert stats["blocked_s"] >= 0.2  # the loop's wait for step 10 is blocked time
    assert store.committed_steps() == [30, 10]
    assert "checkpoint stats: " in caplog.text


def test_synchronous_write_is_blocked_time(tmp_path, monkeypatch):
    store = CheckpointStore(str(tmp_path))
    gate = hold_uploads(store, monkeypatch)
    m = CheckpointManager(store, CheckpointConfig(async_upload=False), 100, Snapshots())
    threading.Timer(0.2, gate.set).start()
    assert m.save(5, must=False)
    assert m.stats.blocked_s >= 0.15 and m.stats.steps == [5]


def test_finish_raises_when_the_final_checkpoint_was_not_committed(tmp_path):
    store = CheckpointStore(str(tmp_path))
    m = CheckpointManager(store, CheckpointConfig(), 100, Snapshots())
    m.save(10, must=True)
    with pytest.raises(RuntimeError, match=r"the final checkpoint \(step 20\) was not committed"):
        m.finish(20)
    # A job resumed at its final step trains nothing and commits nothing new: that is fine.
    resumed = CheckpointManager(store, CheckpointConfig(), 100, Snapshots(), resumed_step=10)
    assert resumed.finish(10)["committed"] == 0


def test_emergency_save_commits_within_the_grace_period_or_says_it_did_not(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="training.checkpoint.manager")
    m = CheckpointManager(CheckpointStore(str(tmp_path / "ok")), CheckpointConfig(), 100, Snapshots())
    m.emergency(7, time.monotonic(), save=True)
    assert "emergency checkpoint at step 7 committed" in caplog.text

    stuck = CheckpointStore(str(tmp_path / "stuck"))
    gate = hold_uploads(stuck, monkeypatch)
    m = CheckpointManager(stuck, CheckpointConfig(preempt_grace_s=0.3), 100, Snapshots())
    started = time.monotonic()
    m.emergency(8, started, save=True)
    assert time.monotonic() - started < 5
    assert "emergency checkpoint at step 8 NOT committed within the grace period" in caplog.text
    gate.set()


def test_other_ranks_save_nothing_but_keep_the_cadence(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="training.checkpoint.manager")
    snapshots = Snapshots()
    m = CheckpointManager(CheckpointStore(str(tmp_path)), CheckpointConfig(every_n_steps=5), 100, snapshots, rank=1)
    now = time.monotonic()
    # Due where rank 0's are: the loop reads its losses back there on every worker.
    assert [g for g in range(1, 21) if m.due(g, g, now)] == [5, 10, 15, 20]
    assert not m.save(5, must=False) and not m.save(6, must=True)
    m.emergency(6, now, save=True)
    assert "SIGTERM on worker 1 at step 6: exiting (only rank 0 writes checkpoints)" in caplog.text
    assert m.finish(6) is None and m.stats is None
    assert snapshots.taken == [] and CheckpointStore(str(tmp_path)).steps() == []


def _commits(caplog) -> dict[int, CheckpointCommitted]:
    events = [parse_event(r.getMessage()) for r in caplog.records if r.name == "events"]
    return {e.step: e for e in events if isinstance(e, CheckpointCommitted)}


def test_each_commit_event_says_what_the_save_blocked_the_loop_and_how_long_it_uploaded(tmp_path, monkeypatch,
                                                                                       caplog):
    """A reader of the event log (benchmarks/big_model.py) gets the loop's blocked time per save
    from the typed event: in the background an upload held 0.3 s is upload time, not blocked time;
    the next save that must wait for it is blocked that long."""
    caplog.set_level(logging.INFO, logger="events")
    store = CheckpointStore(str(tmp_path), keep=5)
    gate = hold_uploads(store, monkeypatch)
    m = CheckpointManager(store, CheckpointConfig(every_n_steps=10), 100, Snapshots())
    assert m.save(10, must=False)
    threading.Timer(0.3, gate.set).start()
    assert m.save(30, must=True)  # waits for step 10's upload
    m.finish(30)
    got = _commits(caplog)
    assert got[10].upload_s >= 0.25 and got[10].blocked_s < 0.2 and got[10].bytes > 0
    assert got[30].blocked_s >= 0.2 and got[30].upload_s < 0.25
    # Together they account for the loop's steady-state blocked time (finish's own wait apart).
    assert got[10].blocked_s + got[30].blocked_s <= m.stats.blocked_s


def test_a_synchronous_commit_event_counts_the_upload_as_blocked(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="events")
    store = CheckpointStore(str(tmp_path))
    gate = hold_uploads(store, monkeypatch)
    m = CheckpointManager(store, CheckpointConfig(async_upload=False), 100, Snapshots())
    threading.Timer(0.2, gate.set).start()
    assert m.save(5, must=False)
    got = _commits(caplog)[5]
    assert got.upload_s >= 0.15 and got.blocked_s >= got.upload_s
