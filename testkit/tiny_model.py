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


def registered_job(tracking_uri: str, model_name: str, shards_prefix: str, manifest: dict, X: np.ndarray,
                   yi: np.ndarray, work_dir: str, *, run_id: str, steps: int = 80,
                   history: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """The training DAG's register step (``register_trained_job``) on a tiny model: the model is
    trained, its files and a metrics file (as a worker writes them) are put in storage beside
    ``shards_prefix``, and the job is registered like a DAG run ``run_id`` of ``mxnet_training``
    would (its debug-recipe config); returns the step's result."""
    from common import storage
    from common.config import recipe
    from common.manifest import manifest_digest
    from training.tracking.job_registration import TrainedJob, register_trained_job

    model_dir = os.path.join(work_dir, f"model-{run_id}")
    train_and_export(model_dir, X, yi, manifest["classes"], manifest["feature_columns"], steps=steps)
    base = f"{shards_prefix.rsplit('/', 1)[0]}/runs/{run_id}"
    for name in os.listdir(model_dir):
        storage.upload_file(os.path.join(model_dir, name), f"{base}/model/{name}")
    history = history or [{"epoch": e, "train_loss": 1.0 / (e + 1), "global_step": 10 * (e + 1),
                           "step_time_s": 0.01} for e in range(3)]
    storage.put_bytes(f"{base}/metrics/train.json", json.dumps(
        {"global_step": history[-1]["global_step"], "history": history}).encode())
    job = TrainedJob(config=recipe("debug", manifest["source_uri"]), dag_id="mxnet_training", run_id=run_id,
                     try_number=1, registered_model_name=model_name, tracking_uri=tracking_uri,
                     shards_prefix=shards_prefix, manifest_digest=manifest_digest(manifest),
                     source_fingerprint=manifest["source_fingerprint"], model_prefix=f"{base}/model",
                     metrics_uri=f"{base}/metrics/train.json", resumed_from_step=0, train_attempts=1,
                     checkpoints_prefix=f"{base}/checkpoints",
                     airflow_run_url=f"http://airflow.test/dags/mxnet_training/runs/{run_id}")
    return register_trained_job(job)
