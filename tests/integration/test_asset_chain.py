"""Data-aware scheduling and lineage on the real Airflow stack (api-server, scheduler,
dag-processor, triggerer; LocalExecutor) against the SeaweedFS and MLflow fixtures.

One stack, one pass, because each training run costs minutes on this 2-core machine:

- ``dataset_landed`` is triggered through the API; its event on the source dataset Asset starts
  an ``mxnet_training`` run by itself (run type ``asset_triggered``, the form's defaults: the
  ``digits`` recipe on ``MXPIPE_DATASET_URI``, here a 400-row slice of digits).
- Two manual runs (``debug`` recipe, their own copy of the data and their own registered model)
  are triggered at the same time, so three runs of the DAG are active together
  (``MXPIPE_MAX_ACTIVE_RUNS=3``): each finishes with its own S3 run partition, checkpoints,
  MLflow run and model version.
- The asset-triggered run's ``register`` emits ``x-mlflow://models/digits-classifier`` (through
  its AssetAlias), which starts a ``model_review`` run for that version; it is approved through
  the HITL API and the version becomes ``champion``.
- The asset-triggered run's MLflow run carries the manifest as an ``mlflow.data`` input (and the
  test split its model was scored on as a second), the curve PNG, the evaluator's confusion
  matrix, the GX report, system metrics and every epoch's metrics; its
  version is tagged with the shards prefix, data fingerprint and DAG run; the "MLflow run"
  extra link, resolved by the API server, is the run's URL.
"""
from __future__ import annotations

import time

import pytest

from common import storage
from training.checkpoint.store import CheckpointStore
from infra.airflow_client import (
    AirflowClient,
    trigger_dag_run,
    wait_for_dag_run,
    wait_for_new_run,
    wait_for_task_state,
)

from testkit.airflow_stack import airflow_stack, wait_until_parked

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

TRAIN, LANDED, REVIEW = "mxnet_training", "dataset_landed", "model_review"
DEFAULT_MODEL = "digits-classifier"
RUN_TIMEOUT_S = 1500
ROWS = 400


def _xcom(client: AirflowClient, dag_id: str, run_id: str, task_id: str) -> dict:
    path = f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value"
    return client.request("GET", path, params={"deserialize": "true"}).json()["value"]


@pytest.fixture(scope="module")
def data(s3_server, digits_csv) -> dict:
    """A slice of digits at three URIs: the default dataset, and one per manual run (runs of one
    dataset share its content-addressed shard cache, which concurrent runs must not race on)."""
    lines = digits_csv.decode().splitlines()
    body = ("\n".join(lines[: ROWS + 1]) + "\n").encode()
    uris = {k: f"s3://{s3_server.bucket}/chain/{k}/digits.csv" for k in ("landed", "a", "b")}
    for uri in uris.values():
        storage.put_bytes(uri, body)
    return uris


@pytest.fixture(scope="module")
def stack(s3_server, mlflow_server, data, tmp_path_factory):
    # A schedule is what makes the DAG asset-aware (MXPIPE_SCHEDULE=none drops both the cron and
    # the Asset); this cron's next time is weeks away.
    env = {"MXPIPE_SCHEDULE": "0 3 1 1 *", "MXPIPE_DATASET_URI": data["landed"], "MXPIPE_MAX_ACTIVE_RUNS": "3", "MXPIPE_GX_DATA_DOCS": "0",
           "MXPIPE_REVIEW_MODELS": DEFAULT_MODEL}
    with airflow_stack(tmp_path_factory.mktemp("chain-home"), s3_server, mlflow_server,
                       {TRAIN: "mxnet_training.py", LANDED: "dataset_landed.py", REVIEW: "model_review.py"},
                       extra_env=env) as cfg:
        yield cfg


def _mlflow(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)


def test_landed_data_trains_concurrently_registers_and_is_reviewed(stack, mlflow_server, data):
    url = stack.airflow_url
    started = time.monotonic()
    with AirflowClient(url) as client:
        client.set_paused(TRAIN, False)
        client.set_paused(REVIEW, False)
        known = {r["dag_run_id"] for r in client.dag_runs(TRAIN)}
    landed = trigger_dag_run(url, LANDED)
    manual = {k: trigger_dag_run(url, TRAIN, {"dataset_uri": data[k], "recipe": "debug", "epochs": 2,
                                              "num_workers": 1, "registered_model_name": f"chain-{k}"})
              for k in ("a", "b")}
    assert wait_for_dag_run(url, LANDED, landed, timeout_s=300, poll_s=3) == "success"
    by_asset = wait_for_new_run(url, TRAIN, known | set(manual.values()), timeout_s=180,
                                run_type="asset_triggered")
    assert by_asset["run_type"] == "asset_triggered"
    runs = {"landed": by_asset["dag_run_id"], **manual}

    for key, run_id in runs.items():
        state = wait_for_dag_run(url, TRAIN, run_id, timeout_s=RUN_TIMEOUT_S, poll_s=5)
        assert state == "success", (key, run_id)
    print(f"three training runs done in {time.monotonic() - started:.0f} s")

    with AirflowClient(url) as client:
        # The three ran side by side: each started before any of them ended.
        spans = [client.dag_run(TRAIN, r) for r in runs.values()]
        assert max(s["start_date"] for s in spans) < min(s["end_date"] for s in spans), spans
        trained = {k: _xcom(client, TRAIN, r, "train") for k, r in runs.items()}
        registered = {k: _xcom(client, TRAIN, r, "register") for k, r in runs.items()}
        links = {t: client.extra_links(TRAIN, runs["landed"], t) for t in ("train", "register")}
    _check_isolation(mlflow_server, runs, trained, registered)
    _check_mlflow_extras(mlflow_server, runs["landed"], registered["landed"])
    assert links["register"]["MLflow run"] == registered["landed"]["run_url"]
    assert links["train"]["MLflow run"] == registered["landed"]["run_url"]

    _check_review(url, stack.home, mlflow_server, registered["landed"]["version"])


def _check_isolation(mlflow_server, runs: dict, trained: dict, registered: dict) -> None:
    prefixes = [t["checkpoint_prefix"] for t in trained.values()]
    assert len(set(prefixes)) == 3 and len({t["model_prefix"] for t in trained.values()}) == 3
    for key, t in trained.items():
        # The run partition: {root}/mxnet_training/{run id, made path-safe}/...
        partition = t["checkpoint_prefix"].rsplit("/checkpoints", 1)[0]
        assert all(not other.startswith(partition + "/") for k, other in
                   ((k2, t2["checkpoint_prefix"]) for k2, t2 in trained.items()) if k != key)
        assert CheckpointStore(t["checkpoint_prefix"], keep=3).committed_steps(), key
    assert len({r["run_id"] for r in registered.values()}) == 3
    c = _mlflow(mlflow_server)
    for key, run_id in runs.items():
        tags = c.get_run(registered[key]["run_id"]).data.tags
        assert tags["airflow.run_id"] == run_id and tags["airflow.dag_id"] == TRAIN
    assert registered["a"]["registered_model_name"] == "chain-a"
    assert registered["b"]["registered_model_name"] == "chain-b"


def _check_mlflow_extras(mlflow_server, run_id: str, registered: dict) -> None:
    c = _mlflow(mlflow_server)
    run = c.get_run(registered["run_id"])
    # The shards it trained on, and the test split register scored the model on (both: the manifest).
    inputs = {i.dataset.name: i.dataset for i in run.inputs.dataset_inputs}
    assert len(inputs) == 2 and "test split" in inputs, inputs
    assert all(d.source_type == "s3" and "manifest.json" in d.source for d in inputs.values()), inputs
    files = {f.path for f in c.list_artifacts(run.info.run_id)}
    files |= {f.path for f in c.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/curves.png", "confusion_matrix.png", "validation.json", "manifest.json"} <= files, files
    metrics = run.data.metrics
    assert any(k.startswith("system/") for k in metrics), sorted(metrics)
    # One point per epoch trained: the digits recipe's epoch budget, or fewer where early stopping
    # (on by default) ended the job.
    stopped = run.data.tags["early_stopped_at"]
    epochs = int(run.data.params["optim.epochs"]) if stopped == "no" else int(stopped) + 1
    assert len(c.get_metric_history(run.info.run_id, "val_accuracy")) == epochs
    version = c.get_model_version(DEFAULT_MODEL, registered["version"])
    assert version.tags["airflow.run_id"] == run_id
    assert version.tags["dataset.shards_prefix"].startswith("s3://")
    assert len(version.tags["dataset.fingerprint"]) >= 16


def _check_review(url: str, home, mlflow_server, version: str) -> None:
    review = wait_for_new_run(url, REVIEW, set(), timeout_s=180, run_type="asset_triggered")
    assert review["run_type"] == "asset_triggered"
    run_id = review["dag_run_id"]
    wait_for_task_state(url, REVIEW, run_id, "approval", "awaiting_input", timeout_s=600, poll_s=3)
    wait_until_parked(home, run_id, "approval")  # an instant answer races the scheduler
    with AirflowClient(url) as client:
        assert _xcom(client, REVIEW, run_id, "resolve")["challenger"] == version
        client.respond(REVIEW, run_id, "approval", ["Approve"], {"comment": "asset chain"})
    assert wait_for_dag_run(url, REVIEW, run_id, timeout_s=300, poll_s=3) == "success"
    assert _mlflow(mlflow_server).get_model_version_by_alias(DEFAULT_MODEL, "champion").version == version
