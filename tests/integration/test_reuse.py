"""training.tracking.reuse against a real MLflow tracking server (fixture ``mlflow_server``): the
registry search by the inputs' digest, one changed input of each kind finding nothing (and
named), a failed run's version never reused, and the record a reuse leaves. Versions are
registered from runs tagged as the register step tags them, without a trained model behind
them (the whole DAG path is in tests/integration/test_dag_run.py)."""
from __future__ import annotations

import dataclasses
import uuid

import pytest

from training.tracking.reuse import (REUSED_BY_TAG, REUSED_VERSION_TAG, TrainingInputs, find_reusable,
                                     record_reuse)
from training.tracking.runs import PIPELINE_EXPERIMENT, dag_run_tags, get_or_create_experiment

pytestmark = pytest.mark.integration

INPUTS = TrainingInputs("m" * 64, "c" * 16, "a" * 64, "s3://bucket/dag/run0/checkpoints@40")
CHANGES = {"data": {"manifest_digest": "n" * 64}, "config": {"config_digest": "d" * 16},
           "model code": {"code_sha256": "b" * 64}, "warm start": {"warm_start": "s3://bucket/dag/run0/checkpoints@80"}}


def _registered(client, name: str, inputs: TrainingInputs, dag_run: str, status: str = "FINISHED") -> str:
    """A version of ``name`` from a run tagged as register tags it, ended with ``status``."""
    experiment = get_or_create_experiment(client, PIPELINE_EXPERIMENT)
    tags = {**dag_run_tags("mxnet_training", dag_run), **inputs.tags()}
    run = client.create_run(experiment, run_name=dag_run, tags=tags)
    client.log_metric(run.info.run_id, "test_accuracy", 0.93)
    client.set_terminated(run.info.run_id, status)
    try:
        client.create_registered_model(name)
    except Exception:  # noqa: BLE001 - exists from an earlier call
        pass
    version = client.create_model_version(name, source=f"s3://bucket/models/{dag_run}", run_id=run.info.run_id,
                                          tags=tags)
    return str(version.version)


@pytest.fixture
def registry(mlflow_server):
    from mlflow import MlflowClient

    uri = mlflow_server.tracking_uri
    return uri, MlflowClient(tracking_uri=uri, registry_uri=uri), f"reuse-{uuid.uuid4().hex[:8]}"


def test_the_same_inputs_find_the_version_and_each_changed_input_finds_nothing(registry):
    uri, client, name = registry
    assert find_reusable(uri, name, INPUTS).match is None  # no such model yet
    version = _registered(client, name, INPUTS, "run1")
    found = find_reusable(uri, name, INPUTS).match
    assert found is not None and (found.version, found.dag_run_id) == (version, "run1")
    assert found.metrics == {"test_accuracy": 0.93}
    for kind, change in CHANGES.items():
        search = find_reusable(uri, name, dataclasses.replace(INPUTS, **change))
        assert search.match is None, kind
        assert (search.newest_version, search.changed) == (version, tuple(change)), kind


def test_a_version_whose_run_failed_is_not_reused_but_a_newer_finished_one_is(registry):
    uri, client, name = registry
    _registered(client, name, INPUTS, "run1", status="FAILED")
    assert find_reusable(uri, name, INPUTS).match is None
    good = _registered(client, name, INPUTS, "run2")
    _registered(client, name, INPUTS, "run3", status="FAILED")
    assert find_reusable(uri, name, INPUTS).match.version == good


def test_a_reuse_is_recorded_on_a_run_of_its_own_and_on_the_version(registry):
    uri, client, name = registry
    version = _registered(client, name, INPUTS, "run1")
    reused = find_reusable(uri, name, INPUTS).match
    out = record_reuse(uri, reused, INPUTS, "mxnet_training", "run2")
    again = record_reuse(uri, reused, INPUTS, "mxnet_training", "run2")  # a retry finds its run again
    assert again["reuse_run_id"] == out["reuse_run_id"]
    assert (out["version"], out["reused_from"], out["test_accuracy"]) == (version, {"dag_id": "mxnet_training",
                                                                                    "run_id": "run1"}, 0.93)
    run = client.get_run(out["reuse_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags[REUSED_VERSION_TAG] == f"{name}/{version}"
    assert run.data.tags["airflow.run_id"] == "run2"
    assert client.get_model_version(name, version).tags[REUSED_BY_TAG] == "mxnet_training/run2"
    # The reuse registered nothing: still one version, and it is still the one found.
    assert len(client.search_model_versions(f"name = '{name}'")) == 1
    assert find_reusable(uri, name, INPUTS).match.version == version
