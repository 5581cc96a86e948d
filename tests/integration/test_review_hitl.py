"""The model-review DAG decided through Airflow's real API: api-server, scheduler, dag-processor
and triggerer from ``airflow_stack``, MLflow and SeaweedFS from the session fixtures.

Three versions of one registered model (tiny Gluon MLPs, ``tiny_model.py``) whose
``dataset.shards_prefix`` tag points at real shards of the same data. Version 1, registered by
the training DAG's register step (so with its model card, whose summary heads the approval
body), is reviewed with no champion yet and approved (it becomes the first champion); version 3 is rejected (tagged,
champion unchanged); version 2 is reviewed because an event on its ``x-mlflow://models/<name>``
Asset was posted through the API (what ``register`` emits), and the run reads the version from
that event, not from its Params (which would pick the challenger alias, on version 3 here);
approving it moves ``champion`` from 1 to 2. Each review passes the automatic gate first (its
table is in the approval's body; the rejected run's gate comes from the run's ``gate`` Param);
version 4, trained for one step, fails it: the version is tagged ``review=gate_failed``, no
approval is requested and the run ends successfully with approval, promote and reject skipped.
Every wait is bounded; the stack's process groups are stopped by the fixture.
"""
from __future__ import annotations

import uuid

import numpy as np
import pandas as pd
import pytest

from infra.airflow_client import AirflowClient, trigger_dag_run, wait_for_dag_run, wait_for_new_run, wait_for_task_state
from testkit.airflow_stack import airflow_stack, wait_until_parked
from testkit.tiny_model import blobs, registered_job, train_and_export

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

DAG_ID = "model_review"
MODEL = f"review-hitl-{uuid.uuid4().hex[:8]}"
CLASSES = ["ant", "bee", "cow"]
NUM_FEATURES = 4
# More metric points than one log_batch may carry (1000): logging them proves the chunking.
EPOCH_POINTS = 1200
WAIT_S = 300


@pytest.fixture(scope="module")
def shards(s3_server) -> dict:
    """Real shards (train/val/test + manifest) of a blob table with string labels."""
    from common import storage
    from data_checks.shard import shard_dataset
    from common.config import recipe

    X, yi = blobs(len(CLASSES), NUM_FEATURES, 600)
    frame = pd.DataFrame(X, columns=[f"f{i}" for i in range(NUM_FEATURES)])
    frame["label"] = np.asarray(CLASSES)[yi]
    base = f"s3://{s3_server.bucket}/review-hitl-{uuid.uuid4().hex[:8]}"
    storage.put_bytes(f"{base}/blobs.csv", frame.to_csv(index=False).encode())
    prefix = f"{base}/shards"
    manifest = shard_dataset(recipe("debug", f"{base}/blobs.csv"), prefix)
    return {"prefix": prefix, "manifest": manifest, "X": X,
            "yi": np.asarray([manifest["classes"].index(c) for c in np.asarray(CLASSES)[yi]])}


def _register(mlflow_server, shards: dict, tmp_path, steps: int, **extra) -> tuple[str, str]:
    """A new version of MODEL trained for ``steps`` steps: ``(version, MLflow run id)``."""
    from training.tracking.registry import ModelRunRequest, log_model_run

    model_dir = str(tmp_path / f"model-{steps}")
    manifest = shards["manifest"]
    train_and_export(model_dir, shards["X"], shards["yi"], manifest["classes"], manifest["feature_columns"],
                     steps=steps)
    result = log_model_run(ModelRunRequest(
        tracking_uri=mlflow_server.tracking_uri, experiment="review-hitl", run_name=f"review-hitl-{steps}",
        tags={"dataset.shards_prefix": shards["prefix"], "airflow.dag_id": "test", "airflow.run_id": f"r{steps}"},
        params={"steps": steps}, epoch_metrics=extra.pop("epoch_metrics", [{"epoch": 0, "train_loss": 1.0}]),
        final_metrics={}, model_dir=model_dir, registered_model_name=MODEL,
        input_example=pd.DataFrame(shards["X"][:5].astype(np.float64), columns=manifest["feature_columns"]),
        **extra))
    return result["version"], result["run_id"]


@pytest.fixture(scope="module")
def stack(s3_server, mlflow_server, tmp_path_factory):
    with airflow_stack(tmp_path_factory.mktemp("review-home"), s3_server, mlflow_server, {DAG_ID: "model_review.py"},
                       extra_env={"MXPIPE_REVIEW_MODELS": MODEL}) as cfg:
        yield cfg


def _mlflow(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)


def _decide(stack, run_id: str, option: str, comment: str) -> dict:
    """Wait for the approval request, check what the reviewer sees, answer it, wait for the end."""
    url, home = stack.airflow_url, stack.home
    wait_for_task_state(url, DAG_ID, run_id, "approval", "awaiting_input", timeout_s=WAIT_S, poll_s=3)
    wait_until_parked(home, run_id, "approval")  # an instant answer races the scheduler
    with AirflowClient(url) as client:
        detail = client.hitl_detail(DAG_ID, run_id, "approval")
        assert detail is not None and set(detail["options"]) == {"Approve", "Reject"}
        client.respond(DAG_ID, run_id, "approval", [option], {"comment": comment})
    assert wait_for_dag_run(url, DAG_ID, run_id, timeout_s=WAIT_S, poll_s=3) == "success"
    with AirflowClient(url) as client:
        states = client.task_states(DAG_ID, run_id)
        path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/resolve/xcomEntries/return_value"
        target = client.request("GET", path, params={"deserialize": "true"}).json()["value"]
    return {"detail": detail, "states": states, "target": target}


def test_first_version_approved_becomes_champion(stack, mlflow_server, shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v1")
    history = [{"epoch": e, "train_loss": 1.0 / (e + 1), "global_step": e + 1, "step_time_s": 0.01}
               for e in range(EPOCH_POINTS)]
    # Through the training DAG's register step, so the version has its model card.
    registered = registered_job(mlflow_server.tracking_uri, MODEL, shards["prefix"], shards["manifest"], shards["X"],
                                shards["yi"], str(tmp), run_id="hitl_1", steps=60, history=history)
    version, run_id = registered["version"], registered["run_id"]
    c = _mlflow(mlflow_server)
    assert len(c.get_metric_history(run_id, "train_loss")) == EPOCH_POINTS  # > 1000: batched

    run = trigger_dag_run(stack.airflow_url, DAG_ID, {"model_name": MODEL, "version": version})
    out = _decide(stack, run, "Approve", "first model")
    assert out["target"]["champion"] is None  # no champion when it was reviewed
    assert f"version {version}" in out["detail"]["subject"]
    # No champion: only the floor applies; the tolerance against a champion is skipped.
    body = out["detail"]["body"]
    # The model card's summary heads the body, with the gate's result the review logged to the card.
    assert body.startswith(f"**Model card** of {MODEL} version {version} (runs:/{run_id}/model\\_card/"
                           "reviewed.html):"), body
    assert "- test (no champion yet): accuracy_score " in body and "- gate: passed" in body, body
    assert c.get_model_version(MODEL, version).tags["model_card"] == "model_card/reviewed.md"
    assert "**Gate: passed.**" in body and "| >= 0.5 | pass |" in body, body
    assert "| >= champion - 0.01 | skipped (no champion) |" in body, body
    _check_evaluation(c, version)
    assert out["states"]["promote"] == "success" and out["states"]["reject"] == "skipped"
    assert c.get_model_version_by_alias(MODEL, "champion").version == version
    tags = c.get_model_version(MODEL, version).tags
    assert tags["review"] == "approved" and tags["review.comment"] == "first model"


def test_reject_tags_and_asset_event_review_moves_champion(stack, mlflow_server, shards, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("v23")
    c = _mlflow(mlflow_server)
    champion = c.get_model_version_by_alias(MODEL, "champion").version
    # Registered last, the rejected one holds the challenger alias: a run that ignored the
    # event's extra would review it (the Params' default), not the version the event names.
    approved, _ = _register(mlflow_server, shards, tmp, 100)
    rejected, _ = _register(mlflow_server, shards, tmp, 20)
    assert c.get_model_version_by_alias(MODEL, "challenger").version == rejected

    manual = trigger_dag_run(stack.airflow_url, DAG_ID, {"model_name": MODEL, "version": rejected, "gate": {
        "accuracy_score": {"greater_is_better": True, "threshold": 0.9, "max_relative_drop": 0.05}}})
    with AirflowClient(stack.airflow_url) as client:
        known = {r["dag_run_id"] for r in client.dag_runs(DAG_ID)}
        # What register emits on a new version (through its AssetAlias).
        client.create_asset_event(f"x-mlflow://models/{MODEL}",
                                  {"registered_model_name": MODEL, "version": approved})
    by_asset = wait_for_new_run(stack.airflow_url, DAG_ID, known, timeout_s=WAIT_S)
    assert by_asset["run_type"] == "asset_triggered"

    out = _decide(stack, manual, "Reject", "worse on ant")
    assert out["target"]["champion"] == champion and out["states"]["reject"] == "success"
    body = out["detail"]["body"]  # the run's own gate, not the default
    assert body.startswith(f"**Model card**: none was logged for {MODEL} version {rejected}"), body
    assert "| >= 0.9 | pass |" in body and "| >= champion - 0.05 x abs(champion) (" in body, body
    tags = c.get_model_version(MODEL, rejected).tags
    assert tags["review"] == "rejected" and tags["review.comment"] == "worse on ant"
    assert c.get_model_version_by_alias(MODEL, "champion").version == champion

    out = _decide(stack, by_asset["dag_run_id"], "Approve", "")
    assert out["target"]["challenger"] == approved
    assert c.get_model_version_by_alias(MODEL, "champion").version == approved


def test_gate_failure_tags_the_version_and_asks_no_one(stack, mlflow_server, shards, tmp_path_factory):
    c = _mlflow(mlflow_server)
    champion = c.get_model_version_by_alias(MODEL, "champion").version
    broken, _ = _register(mlflow_server, shards, tmp_path_factory.mktemp("v4"), 1)  # one step: near chance

    run = trigger_dag_run(stack.airflow_url, DAG_ID, {"model_name": MODEL, "version": broken})
    assert wait_for_dag_run(stack.airflow_url, DAG_ID, run, timeout_s=WAIT_S, poll_s=3) == "success"
    with AirflowClient(stack.airflow_url) as client:
        states = client.task_states(DAG_ID, run)
        assert client.hitl_detail(DAG_ID, run, "approval") is None  # nobody was asked
    assert states == {"resolve": "success", "compare": "success", "gate": "success",
                      "approval": "skipped", "promote": "skipped", "reject": "skipped"}, states

    tags = c.get_model_version(MODEL, broken).tags
    assert tags["review"] == "gate_failed", tags
    assert "accuracy_score" in tags["review.gate"] and "is not >= 0.5" in tags["review.gate"], tags
    review_run = c.get_run(tags["review.run_id"])
    assert review_run.data.tags["review"] == "gate_failed" and review_run.data.metrics["gate.passed"] == 0.0
    assert c.get_model_version_by_alias(MODEL, "champion").version == champion


def _check_evaluation(c, version: str) -> None:
    """The review run holds both sides' figures and confusion matrices; the evaluation ran in a
    nested run whose metrics are linked to the version's LoggedModel."""
    model_id = c.get_model_version(MODEL, version).tags["model_id"]
    experiment = c.get_experiment_by_name("mxnet-pipeline-review").experiment_id
    review_runs = c.search_runs([experiment], filter_string=f"tags.`model.name` = '{MODEL}' "
                                                            f"and tags.`model.challenger` = '{version}'")
    parent = next(r for r in review_runs if "mlflow.parentRunId" not in r.data.tags)
    assert parent.data.metrics["challenger.accuracy_score"] > 0.9 and parent.data.tags["review.gate"] == "passed"
    files = {a.path for a in c.list_artifacts(parent.info.run_id, "review")}
    assert {"review/confusion_challenger.png", "review/comparison.json", "review/gate.md"} <= files, files
    assert {"review/model_card.md", "review/model_card.html"} <= files, files
    # Linked by the review's nested run (and, for a version the register step scored, by its run too).
    linked = [m for m in c.get_logged_model(model_id).metrics if m.key == "accuracy_score"]
    assert linked and all(m.dataset_name == "test split" for m in linked)
    parents = {c.get_run(m.run_id).data.tags.get("mlflow.parentRunId") for m in linked}
    assert parent.info.run_id in parents, parents
