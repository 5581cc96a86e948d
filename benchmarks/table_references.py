#!/usr/bin/env python
"""Q1–Q3: the pipeline on a user's own tables, through the real DAG, against scikit-learn on the
same split.

One ``dag.test()`` process (Airflow's task runner: shard → validate → train on 2 ``dist_sync``
workers → register) runs three confs against a SeaweedFS S3 server and an MLflow server started
here (``dag_services``), with the defaults a user gets (``data.standardize`` on):

- Q1 scikit-learn's ``wine`` (classification, 13 columns of very different scales): the
  registered model's test accuracy ÷ ``StandardScaler + LogisticRegression``'s;
- Q2 scikit-learn's ``diabetes`` (``model.task='regression'``, L2 loss): test R² ÷ ``Ridge``'s;
- Q3 a generated table with a text column and missing values (``data.missing_values='impute'``):
  its test accuracy, and the registered model predicting raw rows with a city the train split
  never had and a missing value in every column.

Same split for both sides: the rows of each split are read back from the run's shards (the model
version's ``dataset.shards_prefix`` tag, each record's source row number), the reference is
fitted on the source rows of the train shards, and both are scored on the **raw** source rows of
the test shards: the registered model through ``mlflow.pyfunc`` (its preprocessing is part of
it), the reference with its own scaling. Deterministic for a seed: a rerun gives the same figures.

    .venv/bin/python benchmarks/table_references.py [--seed 42] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Before anything imports mxnet (it would block scikit-learn's import, see common/record_codec.py).
from sklearn.datasets import load_diabetes, load_wine  # noqa: E402
from sklearn.linear_model import LogisticRegression, Ridge  # noqa: E402
from sklearn.metrics import r2_score  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from testkit.dag_services import embedded_services, use_in_this_process  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from common import record_codec, storage  # noqa: E402
from common.manifest import download_shard, load_manifest, record_width  # noqa: E402
from testkit.dag_runs import airflow_env, run_confs  # noqa: E402
from testkit.cities_table import UNSEEN_ROWS, cities_table  # noqa: E402

# The pipeline's settings per table (the benchmark's config: a user's choice, not the reference's).
COMMON = {"recipe": "debug", "num_workers": 2, "num_servers": 1, "kvstore": "dist_sync", "optimizer": "adam",
          "checkpoint_every_n_steps": 1000}
TABLES: dict[str, dict[str, Any]] = {
    "wine": {"label": "label", "conf": {"epochs": 60, "batch_size": 16, "learning_rate": 0.01}},
    "diabetes": {"label": "progression",
                 "conf": {"epochs": 150, "batch_size": 32, "learning_rate": 0.02,
                          "config": {"model": {"task": "regression", "loss": "l2", "hidden": [64, 32]}}}},
    "cities": {"label": "label",
               "conf": {"epochs": 8, "batch_size": 32, "learning_rate": 0.01,
                        "config": {"data": {"missing_values": "impute"}}}},
}


def frames() -> dict[str, pd.DataFrame]:
    diabetes = load_diabetes(as_frame=True).frame.rename(columns={"target": "progression"})
    return {"wine": load_wine(as_frame=True).frame.rename(columns={"target": "label"}),
            "diabetes": diabetes, "cities": cities_table()}


def split_rows(shards_prefix: str, work: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The manifest and each split's source row numbers, read back from the shards."""
    manifest = load_manifest(shards_prefix)
    ids: dict[str, list[np.ndarray]] = {}
    for shard in manifest["shards"]:
        paths = download_shard(manifest, shards_prefix, shard["name"], work)
        ids.setdefault(shard["split"], []).append(record_codec.read_all(*paths, record_width(manifest))[2])
    return manifest, {k: np.sort(np.concatenate(v)).astype(np.int64) for k, v in ids.items()}


def registered(client: Any, name: str) -> tuple[Any, dict[str, float]]:
    version = client.get_model_version_by_alias(name, "challenger")
    return version, client.get_run(version.run_id).data.metrics


def score(name: str, frame: pd.DataFrame, label: str, model: Any, ids: dict[str, np.ndarray]) -> dict[str, Any]:
    """Pipeline and reference on the same raw test rows; the reference fitted on the train rows."""
    train, test = frame.iloc[ids["train"]], frame.iloc[ids["test"]]
    predicted = model.predict(test.drop(columns=label))[label].to_numpy()
    row: dict[str, Any] = {"train_rows": len(train), "test_rows": len(test)}
    if name == "diabetes":
        ridge = Ridge().fit(train.drop(columns=label), train[label])
        row.update(pipeline=float(r2_score(test[label], predicted)),
                   reference=float(r2_score(test[label], ridge.predict(test.drop(columns=label)))),
                   metric="test R²", reference_name="Ridge()")
    else:
        row.update(pipeline=float(np.mean(predicted.astype(str) == test[label].to_numpy().astype(str))),
                   metric="test accuracy")
        if name == "wine":
            ref = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
            ref.fit(train.drop(columns=label), train[label])
            row.update(reference=float(ref.score(test.drop(columns=label), test[label])),
                       reference_name="StandardScaler + LogisticRegression(max_iter=1000)")
    if "reference" in row:
        row["ratio"] = row["pipeline"] / row["reference"]
    return row


def unseen(model: Any) -> dict[str, Any]:
    """Q3's serving check: raw rows with an unseen city and missing values."""
    out = model.predict(pd.DataFrame(UNSEEN_ROWS))
    labels, probs = out["label"].astype(str).tolist(), out["probability"].astype(float).tolist()
    return {"rows": len(labels), "labels": labels, "probabilities": [round(p, 3) for p in probs],
            "ok": len(labels) == len(UNSEEN_ROWS["city"]) and set(labels) <= {"rich", "north", "south"}
            and all(0 < p <= 1 for p in probs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=42, help="the config's seed (split, initialisation, order)")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()
    tables = frames()
    with tempfile.TemporaryDirectory(prefix="mxpipe-tables-") as tmp, embedded_services(Path(tmp)) as (cfg, services):
        use_in_this_process(services)
        env = airflow_env(os.path.join(tmp, "home"), **services,
                          MXPIPE_ARTIFACT_ROOT=f"s3://{cfg.bucket}/table-references")
        env.pop("AWS_ENDPOINT_URL", None)
        confs = []
        for name, spec in TABLES.items():
            uri = f"s3://{cfg.bucket}/datasets/{name}.csv"
            storage.put_bytes(uri, tables[name].to_csv(index=False).encode())
            conf = {**COMMON, **spec["conf"], "dataset_uri": uri, "label_column": spec["label"],
                    "registered_model_name": f"{name}-reference"}
            conf["config"] = {**conf.get("config", {}), "seed": args.seed}
            confs.append(conf)
        started = time.monotonic()
        outcome, logs = run_confs(env, confs, timeout=3600)
        dag_s = time.monotonic() - started
        failed = [(n, r) for n, r in zip(TABLES, outcome["results"]) if r.get("state") != "success"]
        if failed:
            raise SystemExit(f"DAG runs not successful: {failed}\n{logs[-6000:]}")

        import mlflow
        from mlflow.tracking import MlflowClient

        client = MlflowClient(services["MLFLOW_TRACKING_URI"])
        mlflow.set_tracking_uri(services["MLFLOW_TRACKING_URI"])
        result: dict[str, Any] = {"seed": args.seed, "dag_s": round(dag_s, 1)}
        for name, spec in TABLES.items():
            version, logged = registered(client, f"{name}-reference")
            manifest, ids = split_rows(version.tags["dataset.shards_prefix"], os.path.join(tmp, name))
            model = mlflow.pyfunc.load_model(f"models:/{name}-reference@challenger")
            row = score(name, tables[name], spec["label"], model, ids)
            row.update(settings=spec["conf"], standardize=manifest["preprocessing"]["standardize"]
                       if manifest.get("preprocessing") else None,
                       logged_test_metrics={k: v for k, v in logged.items() if k in ("test_accuracy", "test_r2")},
                       epochs_run=len(client.get_metric_history(version.run_id, "val_loss")))
            if name == "cities":
                row["unseen_rows"] = unseen(model)
                row["test_rows_with_missing"] = int(tables[name].iloc[ids["test"]].isna().any(axis=1).sum())
            result[name] = row
            print(f"{name}: {row['metric']} {row['pipeline']:.4f}"
                  + (f" vs {row['reference']:.4f} ({row['reference_name']}; ratio {row['ratio']:.3f})"
                     if "reference" in row else "")
                  + f"; {row['train_rows']} train / {row['test_rows']} test rows", flush=True)
    result["met"] = {"Q1": result["wine"]["ratio"] >= 1.0, "Q2": result["diabetes"]["ratio"] >= 1.0,
                     "Q3": result["cities"]["unseen_rows"]["ok"]}
    write_json(args.json, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
