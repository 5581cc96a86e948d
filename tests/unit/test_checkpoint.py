import json
import os

import pytest

from common import storage
from training.checkpoint import CheckpointStore, CorruptCheckpoint

pytestmark = pytest.mark.unit


def _save(store, step):
    return store.save(step, {"model.params": f"params-{step}".encode()}, {"global_step": step})


def test_latest_returns_newest_committed(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    for step in (10, 20, 30):
        _save(store, step)
    ckpt = store.latest()
    assert ckpt.step == 30
    assert ckpt.files["model.params"] == b"params-30"
    assert ckpt.state == {"global_step": 30}


def test_uncommitted_checkpoint_is_ignored(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    _save(store, 10)
    # A writer that died after the data files but before the manifest.
    storage.put_bytes(storage.join(store.step_uri(20), "model.params"), b"half")
    assert store.steps() == [20, 10]
    assert store.committed_steps() == [10]
    assert store.latest().step == 10


def test_corrupt_checkpoint_is_skipped(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    _save(store, 10)
    _save(store, 20)
    path = os.path.join(store.step_uri(20), "model.params")
    with open(path, "wb") as fh:
        fh.write(b"params-2X")  # same size, different bytes
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        store.load(20)
    assert store.latest().step == 10


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert CheckpointStore(str(tmp_path / "none"), keep=2).latest() is None


def test_retention_keeps_newest_k_and_deletes_only_after_commit(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (10, 20, 30, 40):
        _save(store, step)
    assert store.committed_steps() == [40, 30]
    assert store.steps() == [40, 30]


def test_recommit_of_same_step_keeps_the_first(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3)
    _save(store, 10)
    manifest = json.loads(storage.get_bytes(storage.join(store.step_uri(10), "MANIFEST.json")))
    _save(store, 10)  # a resumed attempt reaching the same step again
    again = json.loads(storage.get_bytes(storage.join(store.step_uri(10), "MANIFEST.json")))
    assert again == manifest


def test_keep_below_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(str(tmp_path), keep=1)
