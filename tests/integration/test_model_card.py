"""Model cards through the real MLflow server and S3 (session fixtures): the training DAG's register
step (``register_trained_job``) on tiny models over real shards attaches a card to each version,
the second beside the champion's figures; the review's gate (``training.tracking.review``, what
the review DAG's tasks call) logs the card again with its result and returns its summary, which
the approval body shows (tests/integration/test_review_hitl.py checks the body on the real
Airflow stack)."""
from __future__ import annotations

import time
import uuid

import numpy as np
import pandas as pd
import pytest

from testkit.tiny_model import blobs, registered_job

pytestmark = pytest.mark.integration

MODEL = f"card-{uuid.uuid4().hex[:8]}"
CLASSES = ["ant", "bee", "cow"]


@pytest.fixture(scope="module")
def shards(s3_server) -> dict:
    from common import storage
    from common.config import recipe
    from data_checks.shard import shard_dataset

    X, yi = blobs(len(CLASSES), 4, 450)
    frame = pd.DataFrame(X, columns=[f"f{i}" for i in range(4)])
    frame["label"] = np.asarray(CLASSES)[yi]
    base = f"s3://{s3_server.bucket}/card-{uuid.uuid4().hex[:8]}"
    storage.put_bytes(f"{base}/blobs.csv", frame.to_csv(index=False).encode())
    manifest = shard_dataset(recipe("debug", f"{base}/blobs.csv"), f"{base}/shards")
    return {"prefix": f"{base}/shards", "manifest": manifest, "X": X,
            "yi": np.asarray([manifest["classes"].index(c) for c in np.asarray(CLASSES)[yi]])}


def _client(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)


def _text(client, run_id: str, path: str, tmp) -> str:
    return open(client.download_artifacts(run_id, path, str(tmp)), encoding="utf-8").read()


def _register(mlflow_server, shards: dict, tmp, run_id: str, steps: int) -> dict:
    return registered_job(mlflow_server.tracking_uri, MODEL, shards["prefix"], shards["manifest"], shards["X"],
                          shards["yi"], str(tmp), run_id=run_id, steps=steps)


@pytest.fixture(scope="module")
def first(mlflow_server, shards, tmp_path_factory) -> dict:
    started = time.monotonic()
    out = _register(mlflow_server, shards, tmp_path_factory.mktemp("card1"), "card_1", 80)
    print(f"\nregister_trained_job with its card: {time.monotonic() - started:.1f} s")
    return out


def test_the_registered_version_carries_its_card(first, mlflow_server, shards, tmp_path):
    from common.manifest import manifest_digest

    c = _client(mlflow_server)
    mv = c.get_model_version(MODEL, first["version"])
    assert mv.tags["model_card"] == "model_card/registered.md", mv.tags
    assert mv.tags["model_card.html"] == first["model_card"] == "model_card/registered.html"
    assert f"Model card: `runs:/{first['run_id']}/model_card/registered.html`" in mv.description
    assert c.get_logged_model(mv.tags["model_id"]).tags["model_card"] == "model_card/registered.md"

    text = _text(c, first["run_id"], "model_card/registered.md", tmp_path)
    manifest = shards["manifest"]
    assert f"# Model card: {MODEL} version {first['version']}" in text
    assert manifest_digest(manifest) in text and f"| {manifest['splits']['test']['count']} |" in text
    assert "There is no champion yet" in text and "Pending: the review" in text
    assert f"| accuracy\\_score | {first['test_metrics']['accuracy_score']:.4f} | – | – |" in text
    assert "[mxnet\\_training / card\\_1](http://airflow.test/dags/mxnet_training/runs/card_1)" in text
    assert f"]({first['run_url']})" in text and "/runs/card\\_1/checkpoints" in text
    page = _text(c, first["run_id"], "model_card/registered.html", tmp_path)
    assert page.startswith("<!DOCTYPE html>") and "<h2>Lineage</h2>" in page


def test_the_champion_is_compared_and_the_review_logs_the_gate(first, mlflow_server, shards, tmp_path):
    from training.tracking.gate import DEFAULT_GATE
    from training.tracking.review import gate, resolve_target, review

    c = _client(mlflow_server)
    c.set_registered_model_alias(MODEL, "champion", first["version"])
    second = _register(mlflow_server, shards, tmp_path, "card_2", 120)
    text = _text(c, second["run_id"], "model_card/registered.md", tmp_path)
    assert f"Beside champion version {first['version']}: as registered, on the same test split" in text
    mine, theirs = second["test_metrics"]["accuracy_score"], first["test_metrics"]["accuracy_score"]
    assert f"| accuracy\\_score | {mine:.4f} | {theirs:.4f} | {mine - theirs:+.4f} |" in text

    # What the review DAG's compare and gate tasks do.
    uri = mlflow_server.tracking_uri
    target = resolve_target(uri, MODEL, second["version"])
    reviewed = review(uri, target, run_name="card-review")
    outcome = gate(uri, target, reviewed, DEFAULT_GATE)
    assert outcome["passed"], outcome["markdown"]
    summary = outcome["card"]
    assert summary.startswith(f"**Model card** of {MODEL} version {second['version']} (runs:/{second['run_id']}/"
                              "model\\_card/reviewed.html):"), summary
    assert "- gate: passed" in summary and f"(champion version {first['version']})" in summary

    mv = c.get_model_version(MODEL, second["version"])
    assert mv.tags["model_card"] == "model_card/reviewed.md"
    after = _text(c, second["run_id"], "model_card/reviewed.md", tmp_path)
    assert f"**Passed.** Review run {reviewed['review_run_id']}." in after
    assert "the review's evaluation of both versions on this version's test split" in after
    # The registration card stays what was known then; the review run has its own copy.
    assert "Pending: the review" in _text(c, second["run_id"], "model_card/registered.md", tmp_path / "again")
    assert _text(c, reviewed["review_run_id"], "review/model_card.md", tmp_path / "review") == after
