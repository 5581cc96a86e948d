"""Helpers of the checkpoint writer and manager tests: small snapshots, uploads held in flight."""
from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest

from training.checkpoint.state import Snapshot
from training.checkpoint.store import CheckpointStore


def snapshot_at(step: int, nbytes: int = 16) -> Snapshot:
    return Snapshot(step=step, params={"w": np.full(nbytes // 4, step, np.float32)},
                    states={0: np.zeros(2, np.float32)}, optimizer=pickle.dumps({"num_update": step}),
                    state={"global_step": step})


def hold_uploads(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Make the store's saves wait (at most 10 s) for the returned event: an upload in flight."""
    gate = threading.Event()
    real_save = store.save

    def slow_save(step, files, state, **timing):
        gate.wait(10)
        return real_save(step, files, state, **timing)

    monkeypatch.setattr(store, "save", slow_save)
    return gate
