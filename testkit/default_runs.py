"""A user's table trained with the defaults a DAG run gives (``plugins.run_config.resolve`` of
the form's defaults and the user's few settings), as a real local job: shard, train on the
default cluster (2 ``dist_sync`` workers, 1 server), export. Then the exported model, loaded as
the registry serves it (``training.tracking.pyfunc_model``: raw rows in, the targets' units or
class labels out), and a scaled scikit-learn MLP fitted on the same train rows are scored on
the same raw test rows. Shared by ``benchmarks/table_defaults.py`` and the test at small size.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from common import record_codec, storage
from common.manifest import download_shard, record_width
from testkit.local_jobs import make_job, run_local


@dataclass
class Scores:
    pipeline: float  # the exported model's test R² (regression) or accuracy
    reference: float  # StandardScaler + scikit-learn MLP on the same split
    metric: str
    epochs_run: int
    best_epoch: int | None
    train_s: float  # the job, from start to exported model (sharding excluded)
    train_rows: int
    test_rows: int


def dag_defaults(uri: str, label: str, task: str, config: dict[str, Any] | None = None, **form: Any) -> Any:
    """The config a DAG run resolves for a user who sets only the source, the label column and
    (regression) ``model.task``; ``config`` and ``form``: further settings of the run's ``config``
    and form fields (what a user would change)."""
    from common.config import overlay
    from plugins.run_config import resolve

    layer = overlay({"model": {"task": task}} if task == "regression" else {}, config or {})
    return resolve({"dataset_uri": uri, "label_column": label, "config": layer, **form})


def split_rows(manifest: dict[str, Any], shards_prefix: str, work: str) -> dict[str, np.ndarray]:
    """Each split's source row numbers, read back from the shards."""
    ids: dict[str, list[np.ndarray]] = {}
    for shard in manifest["shards"]:
        paths = download_shard(manifest, shards_prefix, shard["name"], work)
        ids.setdefault(shard["split"], []).append(record_codec.read_all(*paths, record_width(manifest))[2])
    return {k: np.sort(np.concatenate(v)).astype(np.int64) for k, v in ids.items()}


def exported_model(model_prefix: str, work: str) -> Any:
    """The exported model as the registered pyfunc model loads it."""
    from training.tracking import pyfunc_model
    from training.tracking.job_registration import download_model

    files = pyfunc_model.find_export_files(download_model(model_prefix, os.path.join(work, "model")))
    return pyfunc_model.load_exported(files["symbol"], files["params"], files["meta"], files.get("preprocessing"))


def reference_score(frame: pd.DataFrame, label: str, task: str, ids: dict[str, np.ndarray], seed: int) -> float:
    """``StandardScaler`` + scikit-learn's MLP (its defaults, one hidden layer of 100 and Adam, but
    up to 500 iterations), fitted on the train rows, scored on the test rows."""
    from sklearn.neural_network import MLPClassifier, MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    train, test = frame.iloc[ids["train"]], frame.iloc[ids["test"]]
    mlp = MLPRegressor(random_state=seed, max_iter=500) if task == "regression" else \
        MLPClassifier(random_state=seed, max_iter=500)
    # A regressor on targets in the thousands needs them scaled too (as the pipeline does).
    if task == "regression":
        from sklearn.compose import TransformedTargetRegressor

        mlp = TransformedTargetRegressor(regressor=mlp, transformer=StandardScaler())
    model = make_pipeline(StandardScaler(), mlp).fit(train.drop(columns=label), train[label])
    return float(model.score(test.drop(columns=label), test[label]))


def pipeline_score(model: Any, frame: pd.DataFrame, label: str, task: str, ids: dict[str, np.ndarray]) -> float:
    from sklearn.metrics import accuracy_score, r2_score

    from training.tracking.pyfunc_model import predict_frame

    test = frame.iloc[ids["test"]]
    out = predict_frame(model, model.features(test.drop(columns=label)))
    if task == "regression":
        return float(r2_score(test[label], out[label]))
    return float(accuracy_score(test[label].astype(str), out["label"].astype(str)))


def train_and_score(frame: pd.DataFrame, label: str, task: str, root: str, *, reference: bool = True,
                    config: dict[str, Any] | None = None, **form: Any) -> Scores:
    """Shard ``frame`` under ``root`` (a local folder), train with the DAG's defaults, score."""
    import json

    from data_checks.shard import shard_dataset

    source = os.path.join(root, "table.csv")
    frame.to_csv(source, index=False)
    cfg = dag_defaults(source, label, task, config, **form)
    shards_prefix = os.path.join(root, "shards")
    manifest = shard_dataset(cfg, shards_prefix)
    job = make_job(cfg, shards_prefix, os.path.join(root, "job"))
    started = time.monotonic()
    run_local(job, storage.join(root, "job", "job.json"), os.path.join(root, "home"))
    train_s = time.monotonic() - started
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    ids = split_rows(manifest, shards_prefix, os.path.join(root, "splits"))
    model = exported_model(job.model_prefix, root)
    best = metrics.get("best") or {}
    return Scores(pipeline=pipeline_score(model, frame, label, task, ids),
                  reference=reference_score(frame, label, task, ids, cfg.seed) if reference else float("nan"),
                  metric="test R²" if task == "regression" else "test accuracy",
                  epochs_run=len(metrics["history"]), best_epoch=best.get("best_epoch"), train_s=train_s,
                  train_rows=len(ids["train"]), test_rows=len(ids["test"]))
