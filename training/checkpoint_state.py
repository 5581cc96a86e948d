"""What a worker puts into a checkpoint and takes back out: parameters, optimizer state, RNG.

- Parameters: a host copy (``asnumpy``) of every parameter, keyed by gluon's structural names
  (what ``save_parameters`` uses), serialised as ``params.npz`` off the training thread.
- Optimizer state (``trainer.states``): ``Updater.get_states(dump_optimizer=True)``, the
  bytes ``Trainer.save_states`` writes: moments/momentum plus the optimizer itself (its update
  counts drive Adam's bias correction). Only with the optimizer on the workers; with it on the
  servers (``dist_async`` or ``optimizer_on='servers'``) a worker cannot read it, and a resume
  restarts it from zero (logged).
- RNG: MXNet's generator state cannot be read back, so every step re-seeds Python, NumPy and
  MXNet from ``(seed, global_step, rank)``. An uninterrupted run and one resumed at any step
  then draw the same numbers (dropout masks, ...). Data order is a pure function of
  ``(seed, epoch, rank)`` already (``training.data.EpochOrder``).
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import random
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.mx import import_mxnet

log = logging.getLogger(__name__)

PARAMS = "params.npz"
STATES = "trainer.states"


@dataclass
class Snapshot:
    """A host-memory copy of everything a checkpoint holds; serialised later, off the loop."""

    step: int
    params: dict[str, np.ndarray]
    states: bytes | None
    state: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.params.values()) + len(self.states or b"")

    def files(self) -> dict[str, bytes]:
        buf = io.BytesIO()
        np.savez(buf, **self.params)
        out = {PARAMS: buf.getvalue()}
        if self.states is not None:
            out[STATES] = self.states
        return out


def step_seed(seed: int, global_step: int, rank: int) -> int:
    digest = hashlib.sha256(f"{seed}:{global_step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def reseed(seed: int, global_step: int, rank: int) -> None:
    """Seed Python, NumPy and MXNet for the step after ``global_step`` (about 0.1 ms)."""
    s = step_seed(seed, global_step, rank)
    random.seed(s)
    np.random.seed(s)
    import_mxnet().random.seed(s)


def saves_optimizer_state(trainer: Any) -> bool:
    return not trainer._update_on_kvstore and bool(trainer._updaters)


def snapshot(net: Any, trainer: Any, step: int, state: dict[str, Any]) -> Snapshot:
    """Copy parameters and optimizer state to host memory (blocks until they are computed)."""
    params = {name: p.data().asnumpy() for name, p in net._collect_params_with_prefix().items()}
    states = trainer._updaters[0].get_states(dump_optimizer=True) if saves_optimizer_state(trainer) else None
    return Snapshot(step=step, params=params, states=states, state=dict(state, optimizer_state=states is not None))


def load_params(net: Any, blob: bytes, ctx: Any) -> None:
    mx = import_mxnet()
    with np.load(io.BytesIO(blob), allow_pickle=False) as arrays:
        params = net._collect_params_with_prefix()
        missing = set(params) - set(arrays.files)
        extra = set(arrays.files) - set(params)
        if missing or extra:
            raise ValueError(f"checkpoint parameters do not match the model: missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        for name, p in params.items():
            p.set_data(mx.nd.array(arrays[name], ctx=ctx, dtype=arrays[name].dtype))


def load_states(trainer: Any, blob: bytes | None, where: str) -> bool:
    """Restore the optimizer state; returns False (and says why) when it restarts from zero."""
    if not saves_optimizer_state(trainer):
        log.warning("optimizer state restarts from zero: it lives on the servers (optimizer_on=servers "
                    "or dist_async), where a worker cannot save or restore it")
        return False
    if blob is None:
        log.warning("optimizer state restarts from zero: %s holds none (written with the optimizer on the servers)",
                    where)
        return False
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, STATES)
        with open(path, "wb") as fh:
            fh.write(blob)
        trainer.load_states(path)
    return True
