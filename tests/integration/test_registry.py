"""training.tracking.registry against a real MLflow tracking server (fixture ``mlflow_server``; its
artifacts live in a real SeaweedFS S3 bucket behind the server's artifact proxy).

A tiny Gluon MLP is trained on separable synthetic data with *string* classes (so the original
label values, not class indices, must come back), exported the way the trainer exports, logged
and registered once per module; the tests then read it back the ways a reviewer or a serving
job would: a fresh interpreter loading ``models:/<name>@challenger`` and the ``mlflow models
predict`` CLI. Both run outside the repository with no PYTHONPATH, which proves the model is
self-contained (logged as code, no pickle, no importable ``training`` package needed). The logged
model is scored on the held-out rows by MLflow's classifier evaluator before it is registered.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pandas as pd
import pytest

from training.tracking.evaluation import TARGET_COLUMN, EvaluationData
from training.tracking.mlflow_params import ParamConflictError
from training.tracking.registry import CHALLENGER_ALIAS, ModelRunRequest, log_model_run
from testkit.tiny_model import blobs, train_and_export

pytestmark = pytest.mark.integration

CLASSES = ["cat", "dog", "eel"]
NUM_FEATURES = 6
FEATURES = [f"px{i}" for i in range(NUM_FEATURES)]
SUBPROCESS_TIMEOUT_S = 240


def _train_and_export(model_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """A few Adam steps on three Gaussian blobs; returns held-out (X, y as class values)."""
    X, yi = blobs(len(CLASSES), NUM_FEATURES, 900)
    train_and_export(model_dir, X[:600], yi[:600], CLASSES, FEATURES)
    return X[600:], np.asarray(CLASSES)[yi[600:]]


def _call_kwargs(tracking_uri: str, model_dir: str, name: str, example: pd.DataFrame, extra: str,
                 test_data: EvaluationData) -> dict:
    return dict(
        tracking_uri=tracking_uri,
        experiment="registry-integration",
        run_name="registry-test",
        tags={"airflow.dag_id": "test_dag", "airflow.run_id": "manual__1"},
        params={"optim": {"learning_rate": 0.05, "optimizer": "adam"}, "model": {"hidden": [16]}, "seed": 7},
        epoch_metrics=[{"epoch": e, "train_loss": 1.0 / (e + 1), "val_accuracy": 0.5 + e / 10} for e in range(3)],
        final_metrics={},
        model_dir=model_dir,
        registered_model_name=name,
        input_example=example,
        artifacts={"extra/notes.txt": extra},
        test_data=test_data,
    )


@pytest.fixture(scope="module")
def logged(mlflow_server, tmp_path_factory):
    base = tmp_path_factory.mktemp("registry")
    model_dir = str(base / "model")
    X_test, y_test = _train_and_export(model_dir)
    frame = pd.DataFrame(X_test.astype(np.float64), columns=FEATURES)
    csv = base / "test.csv"
    frame.to_csv(csv, index=False)
    test_data = EvaluationData(frame=frame.assign(**{TARGET_COLUMN: y_test}), classes=CLASSES, source_uri=str(csv))
    notes = base / "notes.md"
    notes.write_text("extra artifact\n")
    name = f"registry-test-{uuid.uuid4().hex[:8]}"
    kwargs = _call_kwargs(mlflow_server.tracking_uri, model_dir, name, frame.head(5), str(notes), test_data)
    started = time.monotonic()
    result = log_model_run(ModelRunRequest(**kwargs))
    seconds = time.monotonic() - started
    print(f"\nlog_model_run: {seconds:.1f} s -> {result}")
    return {
        "result": result, "kwargs": kwargs, "accuracy": result["test_metrics"]["test_accuracy"], "X": X_test,
        "y": y_test,
        "csv": str(csv), "workdir": str(base), "tracking_uri": mlflow_server.tracking_uri,
    }


def _clean_env(tracking_uri: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    return env


def _linked_metrics(client, model_id: str, run_id: str) -> list:
    return [m for m in client.get_logged_model(model_id).metrics if m.run_id == run_id]


def test_logged_model_carries_the_test_evaluation(logged):
    """MLflow's classifier evaluator scored the logged model on the held-out rows: its metrics are
    on the run and on the version's LoggedModel (with the test split as their dataset), its
    confusion matrix and per-class table on the run; test_accuracy is its accuracy_score."""
    from mlflow import MlflowClient

    r = logged["result"]
    client = MlflowClient(logged["tracking_uri"])
    metrics = r["test_metrics"]
    assert metrics["example_count"] == len(logged["y"])
    assert metrics["test_accuracy"] == metrics["accuracy_score"] > 0.9, metrics
    model_id = client.get_model_version(r["registered_model_name"], r["version"]).tags["model_id"]
    linked = {m.key: m for m in _linked_metrics(client, model_id, r["run_id"])}
    assert {"accuracy_score", "f1_score", "precision_score", "recall_score", "test_accuracy"} <= set(linked), linked
    assert linked["accuracy_score"].dataset_name == "test split"
    assert linked["test_accuracy"].value == linked["accuracy_score"].value == metrics["accuracy_score"]
    run = client.get_run(r["run_id"])
    assert run.data.metrics["f1_score"] == pytest.approx(metrics["f1_score"])
    assert {"confusion_matrix.png", "per_class_metrics.csv"} <= {a.path for a in client.list_artifacts(r["run_id"])}


def test_result_points_at_run_and_registered_version(logged):
    from mlflow import MlflowClient

    r = logged["result"]
    assert r["run_url"] == f"{logged['tracking_uri'].rstrip('/')}/#/experiments/{r['experiment_id']}/runs/{r['run_id']}"
    assert r["model_uri"].startswith("models:/")
    client = MlflowClient(logged["tracking_uri"])
    run = client.get_run(r["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.learning_rate"] == "0.05"
    assert run.data.params["model.hidden"] == "[16]"
    assert run.data.tags["airflow.dag_id"] == "test_dag"
    assert [m.step for m in client.get_metric_history(r["run_id"], "train_loss")] == [0, 1, 2]
    assert run.data.metrics["test_accuracy"] == pytest.approx(logged["accuracy"])
    assert [a.path for a in client.list_artifacts(r["run_id"], "extra")] == ["extra/notes.txt"]


def test_registered_version_has_challenger_alias_and_lineage_tags(logged):
    from mlflow import MlflowClient

    r = logged["result"]
    client = MlflowClient(logged["tracking_uri"])
    mv = client.get_model_version_by_alias(r["registered_model_name"], CHALLENGER_ALIAS)
    assert str(mv.version) == r["version"]
    assert CHALLENGER_ALIAS in mv.aliases
    assert mv.run_id == r["run_id"]
    assert mv.tags["source_run_id"] == r["run_id"]
    assert len(mv.tags["model_sha256"]) == 64
    assert mv.status == "READY"


def test_fresh_process_loads_alias_and_matches_evaluate(logged):
    r = logged["result"]
    code = (
        "import json, sys, time\n"
        "t = time.monotonic()\n"
        "import mlflow.pyfunc, pandas as pd\n"
        f"m = mlflow.pyfunc.load_model('models:/{r['registered_model_name']}@{CHALLENGER_ALIAS}')\n"
        "t_load = time.monotonic() - t\n"
        f"out = m.predict(pd.read_csv({logged['csv']!r}))\n"
        "print(json.dumps({'label': out['label'].tolist(), 'probability': out['probability'].tolist(),\n"
        "                  'columns': list(out.columns), 'load_s': t_load, 'total_s': time.monotonic() - t,\n"
        "                  'training_importable': 'training' in sys.modules}))\n"
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=logged["workdir"], env=_clean_env(logged["tracking_uri"]),
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nfresh process load+predict: {time.monotonic() - started:.1f} s wall, load {out['load_s']:.1f} s")
    assert out["columns"] == ["label", "probability"]
    assert set(out["label"]) <= set(CLASSES)
    accuracy = float(np.mean(np.asarray(out["label"]) == logged["y"]))
    assert accuracy == pytest.approx(logged["accuracy"])
    assert all(1 / len(CLASSES) <= p <= 1 for p in out["probability"])
    logged["fresh_predictions"] = out


def test_cli_models_predict_gives_the_same_predictions(logged):
    r = logged["result"]
    out_path = os.path.join(logged["workdir"], "cli-predictions.json")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mlflow", "models", "predict", "-m", r["model_uri"], "-i", logged["csv"],
         "-t", "csv", "-o", out_path, "--env-manager", "local"],
        cwd=logged["workdir"], env=_clean_env(logged["tracking_uri"]),
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
    )
    print(f"\nmlflow models predict: {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out_path) as f:
        predictions = json.load(f)["predictions"]
    labels = [p["label"] for p in predictions]
    accuracy = float(np.mean(np.asarray(labels) == logged["y"]))
    assert accuracy == pytest.approx(logged["accuracy"])
    fresh = logged.get("fresh_predictions")
    if fresh is not None:
        assert labels == fresh["label"]
        assert [p["probability"] for p in predictions] == pytest.approx(fresh["probability"], rel=1e-6)


def test_retry_reuses_run_and_version_and_rejects_a_changed_param(logged, monkeypatch):
    from mlflow import MlflowClient

    r = logged["result"]
    client = MlflowClient(logged["tracking_uri"])
    model_id = client.get_model_version(r["registered_model_name"], r["version"]).tags["model_id"]
    evaluated = len(_linked_metrics(client, model_id, r["run_id"]))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9/not-this-one")
    again = log_model_run(ModelRunRequest(**{**logged["kwargs"], "run_id": r["run_id"]}))
    assert again == r  # same run, same model, same version, same test metrics: nothing duplicated
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:9/not-this-one"  # left as found
    assert [m.step for m in client.get_metric_history(r["run_id"], "train_loss")] == [0, 1, 2]
    assert len(_linked_metrics(client, model_id, r["run_id"])) == evaluated  # not scored a second time
    assert len(client.get_metric_history(r["run_id"], "test_accuracy")) == 1

    changed = {**logged["kwargs"], "run_id": r["run_id"],
               "params": {**logged["kwargs"]["params"], "optim": {"learning_rate": 0.5, "optimizer": "adam"}}}
    with pytest.raises(ParamConflictError, match=r"optim\.learning_rate: logged '0\.05', now '0\.5'"):
        log_model_run(ModelRunRequest(**changed))
    run = client.get_run(r["run_id"])
    assert run.data.params["optim.learning_rate"] == "0.05"
    assert run.info.status == "FINISHED"  # the refused retry did not mark the run FAILED
    latest = client.get_model_version_by_alias(r["registered_model_name"], CHALLENGER_ALIAS)
    assert str(latest.version) == r["version"]


def test_unreachable_server_fails_fast(logged, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kwargs = {**logged["kwargs"], "tracking_uri": f"http://127.0.0.1:{port}"}
    started = time.monotonic()
    with pytest.raises(Exception) as err:
        log_model_run(ModelRunRequest(**kwargs))
    seconds = time.monotonic() - started
    print(f"\ndead server: failed in {seconds:.1f} s with {type(err.value).__name__}")
    assert seconds < 30
    assert str(port) in str(err.value)
