"""A table with text categories and missing values (imputed) trains through the DAG, and its
registered model predicts on raw rows, with categories it never saw and missing values, in a
fresh process that has neither the project on its path nor its working directory."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from common import storage
from testkit.dag_runs import airflow_env, run_confs
from testkit.cities_table import UNSEEN_ROWS, cities_table

pytestmark = pytest.mark.integration

MODEL = "table-prep-e2e"

PREDICT = """
import json, sys
import mlflow, pandas as pd
mlflow.set_tracking_uri(sys.argv[1])
model = mlflow.pyfunc.load_model(sys.argv[2])
rows = pd.DataFrame(json.loads(sys.argv[3]))
out = model.predict(rows)
print("PREDICTED " + json.dumps({"labels": out["label"].tolist(), "p": out["probability"].tolist(),
                                 "inputs": [i.name for i in model.metadata.get_input_schema().inputs]}))
"""


def test_categorical_table_with_missing_values_trains_and_serves_raw_rows(s3_server, mlflow_server, tmp_path):
    buf = io.StringIO()
    cities_table().to_csv(buf, index=False)
    uri = f"s3://{s3_server.bucket}/datasets/cities.csv"
    storage.put_bytes(uri, buf.getvalue().encode())
    env = airflow_env(str(tmp_path / "home"), MXPIPE_ARTIFACT_ROOT=f"s3://{s3_server.bucket}/prep-runs",
                      MLFLOW_TRACKING_URI=mlflow_server.tracking_uri)
    conf = {"dataset_uri": uri, "label_column": "label", "recipe": "debug", "epochs": 8, "batch_size": 32,
            "learning_rate": 0.01, "num_workers": 2, "checkpoint_every_n_steps": 10,
            "registered_model_name": MODEL, "config": {"data": {"missing_values": "impute"}}}
    outcome, logs = run_confs(env, [conf])
    result = outcome["results"][0]
    assert result.get("state") == "success", logs[-6000:]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.tracking_uri)
    version = client.get_model_version_by_alias(MODEL, "challenger")
    run = client.get_run(version.run_id)
    assert run.data.metrics["test_accuracy"] > 0.8, run.data.metrics
    report = json.loads(open(client.download_artifacts(run.info.run_id, "validation.json", str(tmp_path))).read())
    assert sum(report["imputed"]["train"].values()) > 0 and set(report["imputed"]["train"]) == {"income", "city"}

    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    out = subprocess.run([sys.executable, "-c", PREDICT, mlflow_server.tracking_uri, f"models:/{MODEL}@challenger",
                          json.dumps(UNSEEN_ROWS)], env=clean, cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PREDICTED ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    predicted = json.loads(lines[0][len("PREDICTED "):])
    assert predicted["inputs"] == ["income", "noise", "city"]  # the raw table's columns
    assert predicted["labels"][0] == "rich" and set(predicted["labels"]) <= {"rich", "north", "south"}
    assert all(0 < p <= 1 for p in predicted["p"])
