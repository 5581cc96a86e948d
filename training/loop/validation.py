"""Rank 0's validation at an epoch end: the task's metrics of the network on a held-out split.

One batch loop for both tasks: classification counts the correct argmax, regression keeps the
predictions for ``training.loop.metrics.regression_metrics``; the loss is summed the same way.
A regression network trained on targets standardised on the train split (``TargetScale``) has
its loss taken on that scale and its metrics in the targets' own units.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from common.config import ModelConfig
from common.mx import import_mxnet
from common.preprocessing import TargetScale
from training.loop.metrics import regression_metrics
from training.loop.step import make_loss

__all__ = ["evaluate"]


def evaluate(net: Any, X: np.ndarray, y: np.ndarray, batch: int = 512, ctx: Any = None,
             model: ModelConfig | None = None, targets: TargetScale | None = None) -> dict[str, float]:
    """The task's metrics of ``net`` on ``(X, y)`` (``training.loop.metrics.TASK_METRICS``);
    ``model`` None: classification. Regression ``y`` is in the targets' units."""
    mx = import_mxnet()
    ctx = ctx or mx.cpu()
    regression = model is not None and model.task == "regression"
    loss_fn = make_loss(model) if regression else mx.gluon.loss.SoftmaxCrossEntropyLoss()
    trained = targets.standardize(y) if regression and targets is not None else y
    total_loss, correct, preds = 0.0, 0, []
    for i in range(0, len(y), batch):
        xb, yb = mx.nd.array(X[i:i + batch], ctx=ctx), mx.nd.array(trained[i:i + batch], ctx=ctx)
        out = net(xb)
        total_loss += float(loss_fn(out, yb).sum().asscalar())
        if regression:
            preds.append(out.asnumpy())
        else:
            correct += int((out.argmax(axis=1) == yb).sum().asscalar())
    n = max(len(y), 1)
    if regression:
        predicted = np.concatenate(preds)
        if targets is not None:
            predicted = targets.restore(predicted)
        return {"loss": total_loss / n, **regression_metrics(predicted, y)}
    return {"loss": total_loss / n, "accuracy": correct / n}
