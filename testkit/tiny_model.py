"""A tiny Gluon MLP trained on Gaussian blobs and exported the way the trainer exports
(``net.export`` + ``model_meta.json``): a real model for registry and review tests in seconds."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np


def blobs(num_classes: int, num_features: int, n: int, seed: int = 7,
          sample_seed: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Separable blobs: features ``[n, f]`` float32 and class indices ``[n]``. ``sample_seed``:
    other rows around the same centres (``seed`` places them), e.g. new data for a trained model."""
    rng = np.random.RandomState(seed)
    centers = rng.randn(num_classes, num_features) * 4
    if sample_seed is not None:
        rng = np.random.RandomState(sample_seed)
    yi = rng.randint(0, num_classes, n)
    return (centers[yi] + rng.randn(n, num_features)).astype(np.float32), yi


def train_and_export(model_dir: str, X: np.ndarray, yi: np.ndarray, classes: Sequence[Any],
                     features: Sequence[str], *, steps: int = 80, seed: int = 7,
                     preprocessing: dict[str, Any] | None = None) -> None:
    """``steps`` Adam steps of a 16-unit MLP on ``(X, yi)``, exported into ``model_dir``;
    ``preprocessing`` (a manifest's record; ``X`` then holds the transformed features) goes
    beside it, so the model takes the raw table."""
    from training.tracking.pyfunc_model import _import_mxnet

    mx = _import_mxnet()
    from mxnet import autograd, gluon

    rng = np.random.RandomState(seed)
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(len(classes)))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for _ in range(steps):
        idx = rng.randint(0, len(yi), 64)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(X[idx])), mx.nd.array(yi[idx]))
        loss.backward()
        trainer.step(len(idx))
    os.makedirs(model_dir, exist_ok=True)
    net.export(os.path.join(model_dir, "model"), epoch=0)
    meta = {"feature_columns": list(features), "classes": list(classes), "input_shape": [],
            "num_features": len(features)}
    with open(os.path.join(model_dir, "model_meta.json"), "w") as f:
        json.dump(meta, f)
    if preprocessing is not None:
        with open(os.path.join(model_dir, "preprocessing.json"), "w") as f:
            json.dump(preprocessing, f)
