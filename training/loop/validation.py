"""Rank 0's validation at an epoch end: the task's metrics of the network on a held-out split.

One batch loop for both tasks: classification counts the correct argmax, regression adds each
batch to ``common.task_metrics.RegressionSums`` (``regression_metrics`` over the batches); the
loss is summed the same way. The split is arrays, or rows read a batch at a time from
memory-mapped shards (``training.feed.shard_reader.ShardSet``): memory follows the batch, not
the split.
A regression network trained on targets standardised on the train split (``TargetScale``) has
its loss taken on that scale and its metrics in the targets' own units.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from common.config import ModelConfig
from common.mx import import_mxnet
from common.preprocessing import TargetScale
from common.task_metrics import RegressionSums
from training.loop.step import make_loss

__all__ = ["evaluate"]


def evaluate(net: Any, X: Any, y: np.ndarray | None = None, batch: int = 512, ctx: Any = None,
             model: ModelConfig | None = None, targets: TargetScale | None = None) -> dict[str, float]:
    """The task's metrics of ``net`` on ``(X, y)`` (``training.loop.metrics.TASK_METRICS``), or on
    the rows of ``X`` when ``y`` is None (a ``ShardSet`` without a target scale: ``gather`` gives a
    batch's features and labels or targets); ``model`` None: classification. Regression targets
    are in their own units."""
    mx = import_mxnet()
    ctx = ctx or mx.cpu()
    regression = model is not None and model.task == "regression"
    loss_fn = make_loss(model) if regression else mx.gluon.loss.SoftmaxCrossEntropyLoss()
    n = len(y) if y is not None else X.num_rows
    total_loss, correct, sums = 0.0, 0, RegressionSums()
    for i in range(0, n, batch):
        if y is None:
            xs, ys = X.gather(np.arange(i, min(i + batch, n)))
        else:
            xs, ys = X[i:i + batch], y[i:i + batch]
        trained = targets.standardize(ys) if regression and targets is not None else ys
        xb, yb = mx.nd.array(xs, ctx=ctx), mx.nd.array(trained, ctx=ctx)
        out = net(xb)
        total_loss += float(loss_fn(out, yb).sum().asscalar())
        if regression:
            predicted = out.asnumpy()
            sums.add(targets.restore(predicted) if targets is not None else predicted, ys)
        else:
            correct += int((out.argmax(axis=1) == yb).sum().asscalar())
    if regression:
        return {"loss": total_loss / max(n, 1), **sums.metrics()}
    return {"loss": total_loss / max(n, 1), "accuracy": correct / max(n, 1)}
