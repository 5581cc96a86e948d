"""Two writers on one checkpoint prefix (a split brain: a retried job started while the first still
runs), racing on the same steps with different data, against a real S3 server (SeaweedFS).

What must hold: every committed checkpoint verifies against its own manifest, at every moment
(a reader polls while the writers race), and each step holds exactly one writer's data.
"""
from __future__ import annotations

import threading

import pytest

from common import storage
from training.checkpoint.store import CheckpointStore, CorruptCheckpoint

pytestmark = pytest.mark.integration

STEPS = list(range(10, 170, 10))  # 16 contested steps


def _payload(writer: int, step: int) -> dict[str, bytes]:
    # Different sizes per writer, so a crossed file fails the size check as well as the hash.
    return {"params.npz": f"w{writer}-s{step}|".encode() * (2000 + 700 * writer),
            "trainer.states": f"opt-w{writer}-s{step}|".encode() * (300 + 50 * writer)}


def _race(prefix: str, writers: int = 2) -> tuple[list[str], list[BaseException]]:
    """Both writers save every step at the same moment (a barrier per step) while a reader keeps
    loading every committed step. Returns the reader's verification failures and the errors."""
    stores = [CheckpointStore(prefix, keep=len(STEPS) + 1) for _ in range(writers)]
    barrier = threading.Barrier(writers, timeout=120)
    done = threading.Event()
    failures: list[str] = []
    errors: list[BaseException] = []

    def write(w: int) -> None:
        try:
            for step in STEPS:
                barrier.wait()
                stores[w].save(step, _payload(w, step), {"global_step": step, "writer": w})
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            barrier.abort()

    def read() -> None:
        reader = CheckpointStore(prefix, keep=len(STEPS) + 1)
        while not done.is_set():
            for step in reader.committed_steps():
                try:
                    reader.load(step)
                except CorruptCheckpoint as exc:
                    failures.append(str(exc))

    threads = [threading.Thread(target=write, args=(w,), name=f"writer-{w}") for w in range(writers)]
    watcher = threading.Thread(target=read, name="reader")
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    done.set()
    watcher.join(60)
    assert not any(t.is_alive() for t in (*threads, watcher)), "a racing thread did not finish"
    return failures, errors


def test_two_writers_racing_never_break_a_committed_checkpoint(s3_prefix):
    failures, errors = _race(s3_prefix)
    assert not errors, errors
    assert not failures, f"{len(failures)} verification failures of committed checkpoints, e.g. {failures[:3]}"
    store = CheckpointStore(s3_prefix, keep=len(STEPS) + 1)
    assert store.committed_steps() == sorted(STEPS, reverse=True)
    winners = []
    for step in STEPS:
        ckpt = store.load(step)  # verifies
        w = ckpt.state["writer"]
        assert ckpt.files == _payload(w, step), f"step {step} mixes the writers' files"
        winners.append(w)
    print(f"winners per step: {winners}")
    # The loser discarded its own files: only the winner's remain under each step.
    for step in STEPS:
        names = [u.rsplit("/", 1)[1] for u in storage.list_uris(store.step_uri(step))]
        assert sorted(names) == ["MANIFEST.json", "params.npz", "state.json", "trainer.states"], names
