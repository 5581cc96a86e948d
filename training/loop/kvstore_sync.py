"""The trainer of a kvstore job, built so that every kvstore mode computes what the algorithm says.

Where the optimizer runs (``cluster.optimizer_on``):

- ``servers``: gradients are pushed, the servers apply the optimizer, workers pull weights
  (gluon ``update_on_kvstore=True``). Required by ``dist_async``. A worker cannot save the
  optimizer state (it lives on the servers).
- ``workers``: gradients are all-reduced through the servers (push, sum, pull) and every worker
  applies the same optimizer step to the same summed gradient (``update_on_kvstore=False``).
  A worker holds the optimizer state, so ``Trainer.save_states`` works: what exact resume needs.

The race this module exists for (MXNet 1.9.1, ``dist_sync``, ``update_on_kvstore=False``;
evidence in ``docs/kvstore-correctness.md``): gluon initialises the kvstore lazily, inside the
first ``Trainer.step()``, i.e. *after* the first forward/backward. For each parameter it then
queues, on the threaded engine, ``broadcast`` (rank 0 pushes the initial value, every worker
*pulls* it back into the parameter) immediately followed by ``pushpull`` of the gradient.
With the optimizer on the workers the two operations touch different arrays (the pull writes
the weight, the pushpull reads and writes the gradient), so the engine has no dependency
between them and may send the gradient pushpull first. If the pull reaches the server after
every worker's gradient for that key has been summed, it returns the *summed gradient* as the
"initial weight": that worker silently starts from garbage and drifts away from the others.
With the optimizer on the servers the pushpull writes the weight too, so it is ordered after the
pull and the race cannot happen; with ``MXNET_ENGINE_TYPE=NaiveEngine`` on the workers every
operation runs in program order, so it cannot happen either (the serial engine on the servers
does not help: the reordering is on the worker).

The fix here: initialise the kvstore and the parameters eagerly, when the trainer is built and
before the first forward. The initial pull then writes the weights before the first forward
reads them, and the first gradient exists only after that forward, so the engine orders
pull → forward → backward → pushpull through the weight's and gradient's own variables. The
threaded engine, per-key priorities and the overlap of communication with backward are kept;
nothing per step changes. A side effect for ``dist_async``: ``Init`` ends in a worker barrier
after every worker has sent its optimizer to the servers, so no push is applied by an
optimizer that a late worker's ``set_optimizer`` then replaces.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from common.mx import import_mxnet
from common.config import OPTIMIZER_PLACEMENTS

log = logging.getLogger(__name__)


def update_on_kvstore(optimizer_on: str) -> bool:
    if optimizer_on not in OPTIMIZER_PLACEMENTS:
        raise ValueError(f"optimizer_on must be one of {OPTIMIZER_PLACEMENTS}, got {optimizer_on!r}")
    return optimizer_on == "servers"


def make_trainer(params: Any, optimizer: str, optimizer_params: dict[str, Any], kv: Any,
                 optimizer_on: str, *, batch_size: int) -> Any:
    """A ``gluon.Trainer`` over ``kv`` whose kvstore keys and parameters are already in sync.

    ``batch_size`` is what every ``trainer.step()`` will be called with (the global batch of a
    distributed job): the gradient scale is fixed now because with the optimizer on the servers
    the servers receive the optimizer, scale included, when the kvstore is initialised.
    ``optimizer_params`` must not carry ``rescale_grad`` (``step(batch_size)`` sets it).

    Call it after the parameters hold their final initial values (fresh init or checkpoint) and
    before the first forward pass: that order is what makes the initial pull safe.
    """
    mx = import_mxnet()
    if "rescale_grad" in optimizer_params:
        raise ValueError("pass the batch size, not rescale_grad: trainer.step(batch_size) rescales")
    trainer = mx.gluon.Trainer(params, optimizer, optimizer_params, kvstore=kv,
                               update_on_kvstore=update_on_kvstore(optimizer_on))
    sync_now(trainer, batch_size)
    return trainer


def sync_now(trainer: Any, batch_size: int) -> None:
    """Initialise ``trainer``'s kvstore and push/pull its parameters now instead of at the first
    ``step()`` (see the module docstring for why the lazy order is wrong)."""
    if trainer._kv_initialized:
        raise RuntimeError("the trainer's kvstore is already initialised; build it with make_trainer")
    # What step(batch_size) would set; must be in place before set_optimizer ships it to servers.
    trainer._optimizer.rescale_grad = trainer._scale / batch_size
    trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()
    deferred: Sequence[Any] = trainer._params_to_init
    if deferred:
        # A parameter with deferred shape would be synced lazily again, reopening the race.
        names = ", ".join(p.name for p in deferred)
        raise RuntimeError(f"parameters still have deferred shapes ({names}): run a forward pass "
                           "or give in_units before building the trainer")
    kv = trainer._kvstore
    log.info("kvstore %s initialised (optimizer on the %s)", kv.type if kv else None,
             "servers" if trainer._update_on_kvstore else "workers")


def with_gradient_compression(kv: Any, threshold: float) -> Any:
    """``kv`` with MXNet's 2-bit gradient compression, as a store gluon's Trainer can use.

    MXNet 1.9.1 compresses pushes, but its ``PushPull`` refuses a compressing store
    (``kvstore_dist.h``: "Compression not supported with PushPull", measured here in both
    placements), and gluon's Trainer only calls ``pushpull``. This view sends the same traffic
    as push then pull, MXNet's own compressed path (the Module API's): the push quantises the
    gradient (residual kept per key), and the pull returns the servers' sum (optimizer on the
    workers) or the updated weight (on the servers). The order holds without a barrier: the
    compressed push's engine operation holds the key's communication buffer, which the pull
    writes, and a dist_sync server answers a push only once every worker's push is summed.

    ``threshold`` is compared with each worker's *unscaled* gradient (gluon's backward sums
    over the worker's batch; the 1/global-batch scale is applied later, by the optimizer), so a
    sensible value grows with ``batch_size`` and the input scale (docs/kvstore-correctness.md).
    """
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    log.info("2-bit gradient compression on (threshold %g): pushes go out quantised, pulls in full", threshold)
    return _views().PushThenPull(kv)


def with_key_offset(kv: Any, offset: int) -> Any:
    """``kv`` with every key shifted by ``offset``: several gluon Trainers on one kvstore.

    A Trainer numbers its parameters' keys from 0, and one process has one distributed kvstore,
    so the per-stage trainers of a split model (``training.loop.placement``) would share keys. The
    view forwards to ``kv``'s own methods, so it composes with ``with_gradient_compression``.
    """
    return _views().KeyOffset(kv, offset)


class _ViewClasses:
    """The view classes, built once (they subclass ``mx.kv.KVStore``, and mxnet loads lazily).

    A view shares its base store's handle and holds the base only as an instance attribute, so
    the base lives exactly as long as its last view, as it would without one. The kvstore's
    destructor is where a dist worker waits for engine work, meets the other workers at
    ps-lite's exit barrier and finalises ps-lite. Classes built per call, with the base in a
    closure, kept the base alive in a reference cycle of their own after every view was gone,
    until some later garbage collection or interpreter shutdown.
    """

    def __init__(self) -> None:
        mx = import_mxnet()

        class View(mx.kv.KVStore):
            def __init__(self, base: Any) -> None:  # the base owns (and frees) the handle
                self.handle = base.handle
                self._base = base
                self._updater = None
                self._updater_func = None
                self._str_updater_func = None
                self._is_p3 = False

            def __del__(self) -> None:
                pass

        class PushThenPull(View):
            def pushpull(self, key, value, out=None, priority=0):  # type: ignore[no-untyped-def]
                self.push(key, value, priority)
                self.pull(key, value if out is None else out, priority)

        class KeyOffset(View):
            def __init__(self, base: Any, offset: int) -> None:
                super().__init__(base)
                self._offset = offset

            def _shift(self, key: Any) -> Any:
                if isinstance(key, (list, tuple)):
                    return [k + self._offset for k in key]
                return key + self._offset

            def init(self, key, value):  # type: ignore[no-untyped-def]
                return self._base.init(self._shift(key), value)

            def push(self, key, value, priority=0):  # type: ignore[no-untyped-def]
                return self._base.push(self._shift(key), value, priority)

            def pull(self, key, out=None, priority=0, ignore_sparse=True):  # type: ignore[no-untyped-def]
                return self._base.pull(self._shift(key), out, priority, ignore_sparse)

            def pushpull(self, key, value, out=None, priority=0):  # type: ignore[no-untyped-def]
                return self._base.pushpull(self._shift(key), value, out, priority)

            def broadcast(self, key, value, out, priority=0):  # type: ignore[no-untyped-def]
                return self._base.broadcast(self._shift(key), value, out, priority)

        self.View, self.PushThenPull, self.KeyOffset = View, PushThenPull, KeyOffset


_VIEW_CLASSES: list[_ViewClasses] = []


def _views() -> _ViewClasses:
    if not _VIEW_CLASSES:
        _VIEW_CLASSES.append(_ViewClasses())
    return _VIEW_CLASSES[0]
