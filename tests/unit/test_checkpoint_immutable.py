"""A committed checkpoint never changes: attempt folders, the one winning manifest, garbage
collection that never takes a named file, and checkpoints of the earlier layout."""
import json
import os
import time

import pytest

from common import storage
from training.checkpoint.store import CheckpointStore, CommitTooLate, StepTaken

pytestmark = pytest.mark.unit


def _files(store, step):
    base = store.step_uri(step)
    return sorted(u[len(base) + 1:] for u in storage.list_uris(base))


def _attempt(store, step):
    return json.loads(storage.get_bytes(storage.join(store.step_uri(step), "MANIFEST.json")))["attempt"]


def test_data_files_sit_in_the_attempt_folder_the_manifest_names(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(10, {"params.npz": b"p"}, {"global_step": 10})
    manifest = json.loads(storage.get_bytes(storage.join(store.step_uri(10), "MANIFEST.json")))
    attempt = manifest["attempt"]
    assert {n: m["path"] for n, m in manifest["files"].items()} == {
        "params.npz": f"{attempt}/params.npz", "state.json": f"{attempt}/state.json"}
    assert _files(store, 10) == sorted(["MANIFEST.json", f"{attempt}/params.npz", f"{attempt}/state.json"])


def test_the_second_writer_of_a_step_loses_and_removes_only_its_own_files(tmp_path, caplog):
    first, second = CheckpointStore(str(tmp_path)), CheckpointStore(str(tmp_path))
    first.save(10, {"params.npz": b"first"}, {"writer": 1})
    winner = _attempt(first, 10)
    manifest = storage.get_bytes(storage.join(first.step_uri(10), "MANIFEST.json"))
    caplog.set_level("INFO", logger="training.checkpoint.store")
    second.save(10, {"params.npz": b"second, longer"}, {"writer": 2})
    assert "already committed by another attempt; keeping it" in caplog.text
    assert storage.get_bytes(storage.join(first.step_uri(10), "MANIFEST.json")) == manifest
    assert _files(first, 10) == sorted(["MANIFEST.json", f"{winner}/params.npz", f"{winner}/state.json"])
    assert second.load(10).files == {"params.npz": b"first"}


def test_a_committed_checkpoint_that_does_not_verify_is_never_replaced(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.save(10, {"params.npz": b"good"}, {"global_step": 10})
    with open(store.file_uri(10, "params.npz"), "wb") as fh:
        fh.write(b"rot!")
    manifest = storage.get_bytes(storage.join(store.step_uri(10), "MANIFEST.json"))
    with pytest.raises(StepTaken, match="step 10 is committed by another attempt and does not verify"):
        store.save(10, {"params.npz": b"good"}, {"global_step": 10})
    assert storage.get_bytes(storage.join(store.step_uri(10), "MANIFEST.json")) == manifest
    assert len(_files(store, 10)) == 3  # the refused attempt's files are gone again
    assert isinstance(StepTaken("x"), ValueError)  # the writer does not retry it


def test_an_upload_slower_than_half_the_grace_does_not_commit(tmp_path):
    store = CheckpointStore(str(tmp_path), orphan_grace_s=0.2, before_commit=lambda step: time.sleep(0.15))
    with pytest.raises(CommitTooLate, match="upload took over"):
        store.save(10, {"params.npz": b"p"}, {"global_step": 10})
    assert store.steps() == [] and store.committed_steps() == []


def test_checkpoints_of_the_earlier_layout_load_and_are_pruned(tmp_path):
    """Data files beside the manifest, no ``path``: what the previous version wrote."""
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (10, 20):
        base = store.step_uri(step)
        files = {"params.npz": f"old-{step}".encode(), "state.json": json.dumps({"global_step": step}).encode()}
        for name, data in files.items():
            storage.put_bytes(storage.join(base, name), data)
        manifest = {"step": step, "files": {n: {"bytes": len(d), "sha256": storage.sha256_bytes(d)}
                                            for n, d in files.items()}}
        storage.put_bytes(storage.join(base, "MANIFEST.json"), json.dumps(manifest).encode())
    ckpt = store.latest()
    assert (ckpt.step, ckpt.files, ckpt.state) == (20, {"params.npz": b"old-20"}, {"global_step": 20})
    store.save(30, {"params.npz": b"new"}, {"global_step": 30})  # prunes step 10 whole
    assert store.committed_steps() == [30, 20]
    assert _files(store, 20) == ["MANIFEST.json", "params.npz", "state.json"]  # named: kept


def _age(paths, seconds):
    then = time.time() - seconds
    for p in paths:
        os.utime(p, (then, then))


def test_garbage_collection_takes_only_unnamed_files_and_torn_ones_after_the_grace(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=3, orphan_grace_s=600)
    store.save(10, {"params.npz": b"p10"}, {"global_step": 10})
    store.save(20, {"params.npz": b"p20"}, {"global_step": 20})
    # A dead attempt's files in the committed step 20 (it died before losing the commit race).
    loser = storage.join(store.step_uri(20), "deadbeefdeadbeef", "params.npz")
    storage.put_bytes(loser, b"lost")
    # Torn steps (no manifest): one young (a slower writer may still be uploading), one old.
    young = storage.join(store.step_uri(5), "0123456789abcdef", "params.npz")
    old = storage.join(store.step_uri(7), "fedcba9876543210", "params.npz")
    storage.put_bytes(young, b"y")
    storage.put_bytes(old, b"o")
    _age([young], 60)
    _age([old], 3600)
    store.save(30, {"params.npz": b"p30"}, {"global_step": 30})
    assert not os.path.exists(loser) and not os.path.exists(old)
    assert os.path.exists(young)
    for step in (30, 20, 10):
        assert store.load(step).files == {"params.npz": f"p{step}".encode()}
