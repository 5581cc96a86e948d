"""One optimizer step of a worker: k micro-batches, each split over the worker's contexts.

- Contexts (``cluster.devices_per_worker``): each micro-batch is split evenly over
  ``[cpu(0) .. cpu(n-1)]`` (``gluon.utils.split_and_load``); every context holds a replica of
  the parameters, and the kvstore sums the contexts' gradients before the push (what
  ``device`` / ``dist_device_sync`` and the reference tests cover).
- Accumulation (``optim.accumulate_steps`` = k): with k > 1 the parameters' ``grad_req`` is
  ``'add'``, so k forward/backward passes sum into the gradient buffers; then one
  ``trainer.step`` (one push per parameter, one optimizer update) and the buffers are zeroed.
  ``trainer.step`` is told the samples of all k micro-batches, so the update equals one batch
  of k·b (tests/integration/test_engine_modes.py).
- Feeding: ``load`` turns a step's rows into its micro-batches (``split_and_load`` per context);
  ``run_batch`` trains on them. The worker calls ``load`` ahead of time in a prefetch thread
  (``training.feed.prefetch``); ``run`` does both inline, for callers holding whole arrays.
- Mixed precision (``optim.precision='fp16'``, GPU only): ``mxnet.contrib.amp`` scales the loss
  (dynamic loss scaling) before backward. The config refuses it on CPU; untested here.
- The loss stays on the device. ``__call__`` reads it back at once (one host sync per step);
  the worker's loop uses ``run`` + ``LossCheck`` instead, which keeps up to
  ``LOSS_CHECK_EVERY`` steps' losses on the device and reads them in one sync; the loop also
  reads them before every checkpoint, progress line (every 5 s) and epoch end. Every host sync
  drains MXNet's engine: Python can no longer queue the next steps while the engine runs this
  one, so the tail of one step no longer overlaps the head of the next. The bare Gluon loop
  never waits inside an epoch. Measured on the LeNet benchmark job (2 cores, denormals
  flushed, one process, variants alternating by epoch): a read every 8 steps ran at 0.94 of
  the bare loop, every 32 at 0.99, none at 0.97-1.00 (two runs). So a sync costs about half a step, and reads
  are kept rare. Reading each step's loss 2 or 8 steps behind, instead of all at once, was
  worse (0.87-0.88): each read still waits in the engine's queue. The NaN/inf failure stays
  deterministic and names the exact step. It is raised at the next read: at most
  ``LOSS_CHECK_EVERY - 1`` steps or one progress interval late. The loop reads before every
  checkpoint, so no checkpoint of a diverged model is committed.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np

from common.mx import import_mxnet
from common.config import ModelConfig, TrainConfig
from common.errors import DeterministicError


# One micro-batch as the step consumes it: (features per context, labels per context), NDArrays.
MicroBatch = tuple[list[Any], list[Any]]

# Most steps whose losses wait on the device for one host sync (the NaN/inf check's lag in
# steps; the worker's progress line also bounds it in time).
LOSS_CHECK_EVERY = 256


class NaNLossError(DeterministicError, RuntimeError):
    """The loss became NaN or infinite: a deterministic failure, retrying will not help."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


def contexts(cfg: TrainConfig) -> list[Any]:
    mx = import_mxnet()
    make = mx.gpu if cfg.cluster.device == "gpu" else mx.cpu
    return [make(i) for i in range(cfg.cluster.devices_per_worker)]


def make_loss(model: ModelConfig) -> Any:
    """The gluon loss of ``model.task`` / ``model.loss``: per-sample values of shape ``[batch]``
    (L1, L2 and Huber average over the targets; gluon's L2 is half the squared error)."""
    loss = import_mxnet().gluon.loss
    name = model.loss_name
    if name == "softmax_cross_entropy":
        return loss.SoftmaxCrossEntropyLoss()
    if name == "huber":
        return loss.HuberLoss(rho=model.huber_rho)
    return {"l2": loss.L2Loss, "l1": loss.L1Loss}[name]()


def init_amp(cfg: TrainConfig) -> bool:
    """Turn on AMP before the model is built (amp.init patches the operators it casts)."""
    if cfg.optim.precision != "fp16":
        return False
    from mxnet.contrib import amp

    amp.init()
    return True


def prepare(net: Any, trainer: Any, accumulate_steps: int, use_amp: bool) -> None:
    """Gradient buffers that add up over micro-batches (k > 1), and AMP's loss scaler."""
    if accumulate_steps > 1:
        for p in net.collect_params().values():
            if p.grad_req != "null":
                p.grad_req = "add"
                p.zero_grad()
    if use_amp:
        from mxnet.contrib import amp

        amp.init_trainer(trainer)


class StepRunner:
    """Runs one optimizer step over ``accumulate_steps`` micro-batches of ``batch_size`` rows."""

    def __init__(self, net: Any, trainer: Any, loss_fn: Any, ctxs: Sequence[Any], *, batch_size: int,
                 accumulate_steps: int, global_batch: int, use_amp: bool = False) -> None:
        self.net, self.trainer, self.loss_fn = net, trainer, loss_fn
        self.ctxs = list(ctxs)
        self.batch_size, self.k, self.global_batch = batch_size, accumulate_steps, global_batch
        self.use_amp = use_amp
        self.params = [p for p in net.collect_params().values() if p.grad_req != "null"]
        # What a job reports (and the accumulation test checks): k micro-batches per push.
        self.micro_batches = self.optimizer_steps = 0

    def __call__(self, X: np.ndarray, y: np.ndarray, idx: np.ndarray) -> float:
        """Train on rows ``idx`` (k·b of them); returns the mean loss over them (syncs)."""
        loss = float(self.run(X, y, idx).asscalar()) / len(idx)
        if not math.isfinite(loss):
            raise NaNLossError(f"loss is {loss}")
        return loss

    def run(self, X: np.ndarray, y: np.ndarray, idx: np.ndarray) -> Any:
        """Train on rows ``idx`` without waiting: returns the loss sum, an NDArray of shape (1,)."""
        return self.run_batch(self.load(lambda part: (X[part], y[part]), idx))

    def load(self, gather: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], idx: np.ndarray) -> list[MicroBatch]:
        """The step's k micro-batches of rows ``idx`` as NDArrays split over the contexts.

        ``gather(rows)`` returns ``(features, labels)``. Safe to call from another thread
        (``training.feed.prefetch`` does, a few steps ahead): it reads only fixed attributes.
        """
        mx = import_mxnet()
        split = mx.gluon.utils.split_and_load
        batches = []
        for m in range(self.k):
            Xp, yp = gather(idx[m * self.batch_size:(m + 1) * self.batch_size])
            batches.append((split(Xp, self.ctxs, even_split=True), split(yp, self.ctxs, even_split=True)))
        return batches

    def run_batch(self, batches: list[MicroBatch]) -> Any:
        """Train on micro-batches made by ``load`` without waiting: the loss sum, an NDArray (1,)."""
        mx = import_mxnet()
        total = None
        for xs, ys in batches:
            with mx.autograd.record():
                losses = [self.loss_fn(self.net(xb), yb) for xb, yb in zip(xs, ys)]
            self._backward(losses)
            sums = [loss.sum().as_in_context(self.ctxs[0]) for loss in losses]
            part_sum = sums[0] if len(sums) == 1 else mx.nd.add_n(*sums)  # no copy op for one context
            total = part_sum if total is None else total + part_sum
            self.micro_batches += 1
        self.trainer.step(self.global_batch)
        self.optimizer_steps += 1
        if self.k > 1:
            for p in self.params:
                p.zero_grad()  # an engine write, ordered after the push that reads the gradient
        return total

    def _backward(self, losses: list[Any]) -> None:
        mx = import_mxnet()
        if self.use_amp:
            from mxnet.contrib import amp

            with amp.scale_loss(losses, self.trainer) as scaled:
                mx.autograd.backward(scaled)
        else:
            mx.autograd.backward(losses)


class LossCheck:
    """One epoch's step losses, kept on the device and read back ``every`` steps at a time.

    ``add`` queues a step's loss sum (and reads the batch when ``every`` are pending);
    ``flush`` reads whatever is pending in one sync. The first non-finite loss raises
    ``NaNLossError`` naming its own step, however late it is read. ``loss_sum`` / ``rows`` /
    ``last`` are the epoch's figures, computed exactly as a per-step ``asscalar`` would (same
    float32 sums, same division, same order), so the loss history is unchanged.
    """

    def __init__(self, every: int = LOSS_CHECK_EVERY,
                 on_loss: Callable[[int, float], None] | None = None) -> None:
        self.every = max(1, every)
        self.on_loss = on_loss  # called with (step, loss) for every step, in order, once read
        self.pending: list[tuple[int, Any, int]] = []
        self.loss_sum, self.rows, self.last = 0.0, 0, float("nan")

    def add(self, step: int, total: Any, rows: int) -> None:
        self.pending.append((step, total, rows))
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        mx = import_mxnet()
        pending, self.pending = self.pending, []
        sums = mx.nd.concat(*[t.reshape((1,)) for _, t, _ in pending], dim=0).asnumpy()
        for (step, _, rows), s in zip(pending, sums):
            loss = float(s) / rows
            if not math.isfinite(loss):
                raise NaNLossError(f"loss is {loss}", step)
            self.loss_sum += loss * rows
            self.rows += rows
            self.last = loss
            if self.on_loss is not None:
                self.on_loss(step, loss)
