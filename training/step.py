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
- Mixed precision (``optim.precision='fp16'``, GPU only): ``mxnet.contrib.amp`` scales the loss
  (dynamic loss scaling) before backward. The config refuses it on CPU; untested here.
- The loss stays on the device until the step's end: one host sync per optimizer step, which
  the NaN/inf check needs anyway.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from common.mx import import_mxnet
from training.config import TrainConfig


class NaNLossError(RuntimeError):
    """The loss became NaN or infinite: a deterministic failure, retrying will not help."""


def contexts(cfg: TrainConfig) -> list[Any]:
    mx = import_mxnet()
    make = mx.gpu if cfg.cluster.device == "gpu" else mx.cpu
    return [make(i) for i in range(cfg.cluster.devices_per_worker)]


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
        """Train on rows ``idx`` (k·b of them); returns the mean loss over them."""
        mx = import_mxnet()
        total = None
        for m in range(self.k):
            part = idx[m * self.batch_size:(m + 1) * self.batch_size]
            xs = mx.gluon.utils.split_and_load(X[part], self.ctxs, even_split=True)
            ys = mx.gluon.utils.split_and_load(y[part], self.ctxs, even_split=True)
            with mx.autograd.record():
                losses = [self.loss_fn(self.net(xb), yb) for xb, yb in zip(xs, ys)]
            self._backward(losses)
            part_sum = mx.nd.add_n(*[loss.sum().as_in_context(self.ctxs[0]) for loss in losses])
            total = part_sum if total is None else total + part_sum
            self.micro_batches += 1
        self.trainer.step(self.global_batch)
        self.optimizer_steps += 1
        if self.k > 1:
            for p in self.params:
                p.zero_grad()  # an engine write, ordered after the push that reads the gradient
        loss = float(total.asscalar()) / len(idx)
        if not math.isfinite(loss):
            raise NaNLossError(f"loss is {loss}")
        return loss

    def _backward(self, losses: list[Any]) -> None:
        mx = import_mxnet()
        if self.use_amp:
            from mxnet.contrib import amp

            with amp.scale_loss(losses, self.trainer) as scaled:
                mx.autograd.backward(scaled)
        else:
            mx.autograd.backward(losses)
