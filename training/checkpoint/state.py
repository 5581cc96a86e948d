"""What a worker puts into a checkpoint and takes back out: parameters, optimizer state, RNG.

- Parameters: a copy of every parameter, keyed by gluon's structural names (what
  ``save_parameters`` uses), serialised as ``params.npz`` off the training thread.
- Optimizer state (``trainer.states``): ``Updater.get_states(dump_optimizer=True)``, the
  bytes ``Trainer.save_states`` writes: moments/momentum plus the optimizer itself (its update
  counts drive Adam's bias correction). Only with the optimizer on the workers; with it on the
  servers (``dist_async`` or ``optimizer_on='servers'``) a worker cannot read it, and a resume
  restarts it from zero (logged).
- A split model (``training.loop.placement``) has one Trainer per stage: stage ``i``'s bytes go to
  ``trainer-stage{i}.states`` (each what that stage's ``Trainer.save_states`` writes), and the
  state records every stage's parameter names (``optimizer_stages``), so a resume loads each
  file into the stage holding the same parameters. A replicated model's layout is unchanged
  (one ``trainer.states``, no ``optimizer_stages``). Split checkpoints written before stage
  states existed have ``optimizer_state: false`` and no stage files: their resume restarts the
  optimizer state from zero (logged), as it did then. With another stage layout (a resume with
  another ``cluster.devices_per_worker``) the per-parameter states are moved by name into the
  new stages and the optimizer objects are the fresh ones, built at the checkpoint's global step
  (``training.loop.optim``: the same update counts); see ``restore_optimizer``.
- The snapshot does not wait for the engine: it queues a ``copyto`` of every parameter and state
  array. MXNet's engine orders each copy after the update that wrote the array and before the
  next step's update overwrites it, so the copies hold exactly this step's values while the
  training thread goes on; the writer thread's ``asnumpy`` is what waits for them. The loop is
  blocked only for queueing the copies and pickling the (small) optimizer object.
- RNG: MXNet's generator state cannot be read back, so every step re-seeds Python, NumPy and
  (when the network draws from it, e.g. dropout) MXNet from ``(seed, global_step, rank)``. An uninterrupted run and one resumed at any step
  then draw the same numbers (dropout masks, ...). Data order is a pure function of
  ``(seed, epoch, rank)`` already (``training.feed.data.EpochOrder``).
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.config import ConfigError
from common.mx import import_mxnet

log = logging.getLogger(__name__)

PARAMS = "params.npz"
STATES = "trainer.states"
STAGE_STATES = "trainer-stage{}.states"  # split model: stage i's Trainer (training.loop.placement)


@dataclass
class Snapshot:
    """A copy of everything a checkpoint holds, taken at one step; serialised later, off the loop.

    ``params`` and the arrays inside ``states`` are MXNet NDArray copies (or NumPy arrays);
    ``optimizer`` is the pickled optimizer object (update counts, learning-rate schedule).
    ``stages`` holds a split model's ``(states, optimizer)`` per stage instead (``states`` and
    ``optimizer`` are then None).
    """

    step: int
    params: dict[str, Any]
    states: Any
    optimizer: bytes | None
    state: dict[str, Any]
    stages: list[tuple[Any, bytes]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        arrays = _arrays(self.states) + _arrays([states for states, _ in self.stages])
        return sum(_nbytes(a) for a in self.params.values()) + sum(_nbytes(a) for a in arrays)

    def files(self) -> dict[str, bytes]:
        """Serialise (waits for the engine's copies; safe from another thread)."""
        buf = io.BytesIO()
        np.savez(buf, **{name: _host(a) for name, a in self.params.items()})
        out = {PARAMS: buf.getvalue()}
        # The bytes Trainer.save_states writes: pickle((states, optimizer)).
        if self.optimizer is not None:
            out[STATES] = pickle.dumps((self.states, pickle.loads(self.optimizer)))
        for i, (states, optimizer) in enumerate(self.stages):
            out[STAGE_STATES.format(i)] = pickle.dumps((states, pickle.loads(optimizer)))
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


def reseed(seed: int, global_step: int, rank: int, *, mxnet: bool = True) -> None:
    """Seed Python, NumPy and (``mxnet``) MXNet for the step after ``global_step``.

    Python and NumPy take about 0.06 ms. ``mx.random.seed`` returns in microseconds but queues
    engine work that re-seeds every CPU generator (1024 Mersenne Twisters in the parallel one):
    1.9 ms of CPU per call measured here, about 4 % of a LeNet step on 2 cores. The worker
    passes ``mxnet=False`` when its network draws no MXNet random numbers
    (``training.loop.model.draws_random``): the generator is then never read, so its seed changes
    nothing.
    """
    s = step_seed(seed, global_step, rank)
    random.seed(s)
    np.random.seed(s)
    if mxnet:
        import_mxnet().random.seed(s)


def stage_trainers(trainer: Any) -> list[Any]:
    """The gluon Trainers behind ``trainer``: a split model's per-stage ones, or itself."""
    return list(getattr(trainer, "trainers", None) or [trainer])


def saves_optimizer_state(trainer: Any) -> bool:
    return all(not t._update_on_kvstore and bool(t._updaters) for t in stage_trainers(trainer))


def stage_layout(net: Any, trainer: Any) -> list[list[str]]:
    """Each stage Trainer's parameters by structural name, in its key (index) order."""
    names = {id(p): name for name, p in net._collect_params_with_prefix().items()}
    return [[names[id(p)] for p in t._params] for t in stage_trainers(trainer)]


def _updater_copy(trainer: Any) -> tuple[Any, bytes]:
    updater = trainer._updaters[0]
    return _copy(updater.states), pickle.dumps(updater.optimizer)


def snapshot(net: Any, trainer: Any, step: int, state: dict[str, Any]) -> Snapshot:
    """Queue copies of the parameters and optimizer state; returns without waiting for them."""
    # The first context's replica: every context holds the same values after a step, and
    # ``p.data()`` without a context only works on the current (CPU) context.
    params = {name: p.list_data()[0].copyto(p.list_data()[0].context)
              for name, p in net._collect_params_with_prefix().items()}
    states, optimizer, stages = None, None, []
    state = dict(copy.deepcopy(state), optimizer_state=saves_optimizer_state(trainer))
    if state["optimizer_state"]:
        if hasattr(trainer, "trainers"):
            stages = [_updater_copy(t) for t in trainer.trainers]
            state["optimizer_stages"] = stage_layout(net, trainer)
        else:
            states, optimizer = _updater_copy(trainer)
    return Snapshot(step=step, params=params, states=states, optimizer=optimizer, state=state, stages=stages)


def load_params(net: Any, blob: bytes, ctx: Any) -> None:
    mx = import_mxnet()
    with np.load(io.BytesIO(blob), allow_pickle=False) as arrays:
        params = net._collect_params_with_prefix()
        missing = set(params) - set(arrays.files)
        extra = set(arrays.files) - set(params)
        if missing or extra:
            raise ConfigError(f"checkpoint parameters do not match the model: missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        for name, p in params.items():
            # In place, into every context's copy: what Parameter.set_data does, without its reset
            # of the trainer's kvstore, which a distributed kvstore refuses with the optimizer on
            # the servers (the best epoch's parameters are loaded after training, trainer attached).
            value = mx.nd.array(arrays[name], ctx=ctx, dtype=arrays[name].dtype)
            for arr in p.list_data():
                arr[:] = value


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


def restore_optimizer(trainer: Any, net: Any, files: dict[str, bytes], state: dict[str, Any], where: str) -> bool:
    """A checkpoint's optimizer state into ``trainer`` (one Trainer, or a split model's stages);
    returns False (and says why) when it restarts from zero."""
    if not hasattr(trainer, "trainers"):
        return load_states(trainer, files.get(STATES), where)
    layout = state.get("optimizer_stages")
    if not layout:
        log.warning("optimizer state restarts from zero: %s holds none (a split-model checkpoint written "
                    "before checkpoints held every stage's optimizer state)", where)
        return False
    if layout == stage_layout(net, trainer):  # the same stages: each Trainer gets its own bytes back
        return all([load_states(t, files[STAGE_STATES.format(i)], where) for i, t in enumerate(trainer.trainers)])
    # Another split (devices_per_worker changed): every parameter's state by name into its new
    # stage; the optimizers stay the fresh ones, built at the checkpoint's global step.
    by_name: dict[str, Any] = {}
    for i, names in enumerate(layout):
        stage_states, _ = pickle.loads(files[STAGE_STATES.format(i)])
        by_name.update({name: stage_states[j] for j, name in enumerate(names) if j in stage_states})
    for t, names in zip(trainer.trainers, stage_layout(net, trainer)):
        moved = pickle.dumps({j: by_name[name] for j, name in enumerate(names) if name in by_name})
        for updater in t._updaters:
            updater.set_states(moved)
    log.info("optimizer state of %d stages moved by parameter name into %d stages", len(layout),
             len(trainer.trainers))
    return True
