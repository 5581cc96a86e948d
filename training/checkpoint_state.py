"""What a worker puts into a checkpoint and takes back out: parameters, optimizer state, RNG.

- Parameters: a copy of every parameter, keyed by gluon's structural names (what
  ``save_parameters`` uses), serialised as ``params.npz`` off the training thread.
- Optimizer state (``trainer.states``): ``Updater.get_states(dump_optimizer=True)``, the
  bytes ``Trainer.save_states`` writes: moments/momentum plus the optimizer itself (its update
  counts drive Adam's bias correction). Only with the optimizer on the workers; with it on the
  servers (``dist_async`` or ``optimizer_on='servers'``) a worker cannot read it, and a resume
  restarts it from zero (logged).
- The snapshot does not wait for the engine: it queues a ``copyto`` of every parameter and state
  array. MXNet's engine orders each copy after the update that wrote the array and before the
  next step's update overwrites it, so the copies hold exactly this step's values while the
  training thread goes on; the writer thread's ``asnumpy`` is what waits for them. The loop is
  blocked only for queueing the copies and pickling the (small) optimizer object.
- RNG: MXNet's generator state cannot be read back, so every step re-seeds Python, NumPy and
  MXNet from ``(seed, global_step, rank)``. An uninterrupted run and one resumed at any step
  then draw the same numbers (dropout masks, ...). Data order is a pure function of
  ``(seed, epoch, rank)`` already (``training.data.EpochOrder``).
"""
from __future__ import annotations

import copy
import hashlib
import io
import logging
import os
import pickle
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
    """A copy of everything a checkpoint holds, taken at one step; serialised later, off the loop.

    ``params`` and the arrays inside ``states`` are MXNet NDArray copies (or NumPy arrays);
    ``optimizer`` is the pickled optimizer object (update counts, learning-rate schedule).
    """

    step: int
    params: dict[str, Any]
    states: Any
    optimizer: bytes | None
    state: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(a) for a in self.params.values()) + sum(_nbytes(a) for a in _arrays(self.states))

    def files(self) -> dict[str, bytes]:
        """Serialise (waits for the engine's copies; safe from another thread)."""
        buf = io.BytesIO()
        np.savez(buf, **{name: _host(a) for name, a in self.params.items()})
        out = {PARAMS: buf.getvalue()}
        if self.optimizer is not None:
            # The bytes Trainer.save_states writes: pickle((states, optimizer)).
            out[STATES] = pickle.dumps((self.states, pickle.loads(self.optimizer)))
        return out


def _copy(obj: Any) -> Any:
    """A non-blocking engine copy of every NDArray in a (nested) optimizer state."""
    if obj is None:
        return None
    if isinstance(obj, (tuple, list)):
        return type(obj)(_copy(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if hasattr(obj, "copyto"):
        return obj.copyto(obj.context)
    return copy.deepcopy(obj)


def _arrays(obj: Any) -> list[Any]:
    if isinstance(obj, (tuple, list)):
        return [a for o in obj for a in _arrays(o)]
    if isinstance(obj, dict):
        return [a for v in obj.values() for a in _arrays(v)]
    return [obj] if hasattr(obj, "shape") else []


def _nbytes(a: Any) -> int:
    return int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize


def _host(a: Any) -> np.ndarray:
    return a.asnumpy() if hasattr(a, "asnumpy") else np.asarray(a)


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
    """Queue copies of the parameters and optimizer state; returns without waiting for them."""
    # The first context's replica: every context holds the same values after a step, and
    # ``p.data()`` without a context only works on the current (CPU) context.
    params = {name: p.list_data()[0].copyto(p.list_data()[0].context)
              for name, p in net._collect_params_with_prefix().items()}
    states, optimizer = None, None
    if saves_optimizer_state(trainer):
        updater = trainer._updaters[0]
        states, optimizer = _copy(updater.states), pickle.dumps(updater.optimizer)
    return Snapshot(step=step, params=params, states=states, optimizer=optimizer,
                    state=dict(copy.deepcopy(state), optimizer_state=states is not None))


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
