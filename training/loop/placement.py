"""Model parallelism inside a worker: the model's blocks split over the worker's contexts.

``model.placement='split'`` cuts the network's top-level blocks into
``cluster.devices_per_worker`` contiguous stages and keeps stage ``i``'s parameters on context
``i`` only (``cpu(i)`` here, ``gpu(i)`` on a GPU host); the activations are copied from stage to
stage in the forward pass and autograd copies the gradients back. Across workers it is the
usual data parallelism through the kvstore: every worker holds the whole model, split the same
way, and its gradients are summed through the servers (hybrid parallelism). With the default
``'replicated'`` placement every context holds a whole replica and gets a slice of the batch.

What MXNet 1.9 gluon allows, and what that costs here:

- A ``gluon.Trainer`` refuses parameters on different sets of contexts ("All Parameters must be
  initialized on the same set of contexts"), so a split model gets one Trainer per stage,
  each on a key-shifted view of the one kvstore (``kvstore_sync.with_key_offset``; a process
  has one distributed kvstore, and every Trainer numbers its keys from 0). ``StagedTrainer``
  steps them together.
- A hybridized graph (CachedOp) runs on one context, so each block is hybridized on its own;
  the whole network is never one graph while split. For ``export`` the parameters are moved
  to the first context and the original network is hybridized whole.
- No pipelining: a micro-batch passes the stages one after another, so this buys memory (each
  context holds only its stage's parameters, gradients and optimizer state), not speed.
- Only with the optimizer on the workers: with it on the servers every stage's Trainer would
  send its own optimizer to the servers, each replacing the last. A checkpoint holds every
  stage's optimizer state and optimizer (``training.checkpoint.state``: one states file per
  stage), so a resume is exact as for a replicated model.
- fp16 (AMP) is not combined with it (untested; the config refuses it).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from common.config import ConfigError
from common.mx import import_mxnet
from training.loop.kvstore_sync import make_trainer, with_key_offset

# Keys per stage: each stage's Trainer gets keys [i * KEY_STRIDE, i * KEY_STRIDE + its params).
KEY_STRIDE = 10_000


class SplitNet:
    """The network of ``build_model`` with its top-level blocks in stages on ``ctxs``.

    Duck-typed to what the worker needs of a gluon block (call, ``collect_params``,
    ``_collect_params_with_prefix``, ``initialize``, ``hybridize``, ``export``); parameter names
    are the unsplit network's, so checkpoints carry the same names in both placements.
    """

    def __init__(self, net: Any, ctxs: Sequence[Any]) -> None:
        blocks = list(net._children.values())
        if len(blocks) < len(ctxs):
            raise ConfigError(f"model.placement='split': the model has {len(blocks)} top-level blocks, fewer than "
                             f"the {len(ctxs)} contexts to split it over")
        self.net, self.ctxs = net, list(ctxs)
        self._in_shape: tuple[int, ...] = ()
        self.stages = [[blocks[i] for i in part] for part in np.array_split(np.arange(len(blocks)), len(ctxs))]

    def describe(self) -> str:
        """Where each parameter lives, e.g. ``cpu(0): dense0_weight, dense0_bias | cpu(1): …``."""
        return " | ".join(f"{ctx}: " + ", ".join(f"{p.name}@{p.list_ctx()[0]}" for p in params)
                          for ctx, params in zip(self.ctxs, self.stage_params()))

    def __call__(self, x: Any) -> Any:
        home = x.context
        self._in_shape = x.shape[1:]  # what export feeds the unsplit network
        for ctx, stage in zip(self.ctxs, self.stages):
            x = x.as_in_context(ctx)
            for block in stage:
                x = block(x)
        return x.as_in_context(home)  # callers compare with labels on the input's context

    def initialize(self, init: Any, ctx: Any = None) -> None:
        for stage_ctx, stage in zip(self.ctxs, self.stages):
            for block in stage:
                block.initialize(init, ctx=stage_ctx)

    def hybridize(self) -> None:
        for stage in self.stages:
            for block in stage:
                block.hybridize()

    def collect_params(self) -> Any:
        return self.net.collect_params()

    def _collect_params_with_prefix(self) -> dict[str, Any]:
        return self.net._collect_params_with_prefix()

    def stage_params(self) -> list[list[Any]]:
        """Each stage's trainable-or-not parameters, in a fixed (name) order on every worker."""
        out = []
        for stage in self.stages:
            params: dict[str, Any] = {}
            for block in stage:
                params.update(block.collect_params())
            out.append([params[name] for name in sorted(params)])
        return out

    def export(self, path: str, epoch: int = 0) -> None:
        """Gather every parameter on the first context and export the unsplit network."""
        mx = import_mxnet()
        self.net.collect_params().reset_ctx(self.ctxs[0])
        self.net.hybridize()
        self.net(mx.nd.zeros((1, *self._in_shape), ctx=self.ctxs[0]))
        self.net.export(path, epoch=epoch)


class StagedTrainer:
    """One gluon Trainer per stage, stepped together; looks like one Trainer to the worker."""

    def __init__(self, trainers: Sequence[Any]) -> None:
        self.trainers = list(trainers)  # what checkpoint_state saves and restores, stage by stage

    @property
    def _optimizer(self) -> Any:
        return self.trainers[0]._optimizer  # every stage's optimizer has the same schedule and count

    def step(self, batch_size: int) -> None:
        for trainer in self.trainers:
            trainer.step(batch_size)


def make_split_trainer(net: SplitNet, optimizer: str, optimizer_params: Callable[[], dict[str, Any]], kv: Any,
                       *, batch_size: int) -> StagedTrainer:
    """Per-stage trainers over key-shifted views of ``kv``, each synced before the first forward
    (``kvstore_sync.make_trainer``). ``optimizer_params`` makes a fresh dict (and LR scheduler)
    per stage."""
    trainers = [make_trainer(params, optimizer, optimizer_params(), with_key_offset(kv, i * KEY_STRIDE), "workers",
                             batch_size=batch_size)
                for i, params in enumerate(net.stage_params())]
    return StagedTrainer(trainers)
