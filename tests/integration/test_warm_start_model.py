"""Warm start from a registered model version (``models:/<name>/<version>``, ``models:/<name>@<alias>``)
against a real MLflow tracking server and a real SeaweedFS (fixtures), from a real run.

A real 2-worker ``dist_sync`` job trains under the run paths of a DAG run id, and its export is
logged and registered with the tags the ``register`` task sets (``airflow.dag_id``,
``airflow.run_id``; alias ``challenger``). Then:

- the shard task's check resolves both reference forms to that run's final checkpoint;
- a job warm-started from what it returned, trained at a learning rate of 1e-12, ends with the
  registered version's own exported parameters (so it really started from them);
- a missing model, version or alias, and a version not registered by the pipeline, are refused
  with a message that names them; through ``dag.test()`` they fail the shard task on its first
  try, with nothing provisioned (no retry burnt).
"""
import dataclasses
import io
import json
import os
import uuid

import numpy as np
import pytest

from common import storage
from testkit.dag_runs import airflow_env, run_confs
from testkit.local_jobs import make_job, run_job

pytestmark = pytest.mark.integration

DAG_ID, SOURCE_RUN = "mxnet_training", "manual__2026-12-03T10:00:00+00:00"
OVERRIDES = {"optim": {"epochs": 1}, "checkpoint": {"every_n_steps": 7, "keep": 2, "async_upload": False}}


@pytest.fixture(scope="module")
def registered(s3_server, mlflow_server, digits_csv, tmp_path_factory):
    """A real run's checkpoints under its run paths, and its model registered as version 1."""
    import pandas as pd

    from plugins.pipeline_tasks import run_paths
    from common.manifest import load_manifest
    from common.config import recipe
    from training.tracking.job_registration import download_model
    from training.tracking.registry import ModelRunRequest, log_model_run

    tmp = tmp_path_factory.mktemp("warm-model")
    root = f"s3://{s3_server.bucket}/warm-model-{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MXPIPE_ARTIFACT_ROOT", root)
        source = storage.join(root, "digits.csv")
        storage.put_bytes(source, digits_csv)
        cfg = recipe("debug", source).replace(**OVERRIDES)
        from data_checks.shard import shard_dataset

        shards = storage.join(root, "shards")
        shard_dataset(cfg, shards)
        paths = run_paths(DAG_ID, SOURCE_RUN)
        job = dataclasses.replace(make_job(cfg, shards, paths.base), checkpoint_prefix=paths.checkpoints,
                                  model_prefix=paths.model)
        run_job(job, paths.base, tmp)
        metrics = json.loads(storage.get_bytes(job.metrics_uri))
        model_dir = download_model(paths.model, str(tmp / "model"))
        manifest = load_manifest(shards)
        example = pd.DataFrame(np.zeros((2, manifest["num_features"])), columns=manifest["feature_columns"])
        name = f"warm-{uuid.uuid4().hex[:8]}"
        common = dict(tracking_uri=mlflow_server.tracking_uri, experiment="warm-start-model", params={"seed": 1},
                      epoch_metrics=metrics["history"], model_dir=str(model_dir), input_example=example,
                      final_metrics={"global_step": metrics["global_step"]},
                      step_metrics=metrics["step_history"])
        # The tags training.tracking.job_registration sets on the run and so on every version.
        version = log_model_run(ModelRunRequest(run_name=f"{DAG_ID}/{SOURCE_RUN}", registered_model_name=name,
                                                tags={"airflow.dag_id": DAG_ID, "airflow.run_id": SOURCE_RUN},
                                                **common))
        # A version of another model registered without them (not by this pipeline).
        foreign = f"{name}-foreign"
        log_model_run(ModelRunRequest(run_name="by-hand", registered_model_name=foreign, tags={}, **common))
        yield {"root": root, "cfg": cfg, "shards": shards, "paths": paths, "name": name, "foreign": foreign,
               "version": version, "final_step": metrics["global_step"], "tmp": tmp, "common": common,
               "tracking_uri": mlflow_server.tracking_uri}


def _check(ref, cfg):
    from plugins.pipeline_tasks import warm_start_checkpoint

    return warm_start_checkpoint({"warm_start": ref}, DAG_ID, "manual__2026-12-03T11:00:00+00:00", cfg)


def _version_params(uri, tmp, tracking_uri):
    """The arrays of a registered version's exported ``-NNNN.params`` file, as downloaded from MLflow
    (the server named explicitly: a test run earlier in this process may have left MLflow's fluent
    API pointing elsewhere, see ``training.tracking.runs.fluent_tracking_uri``)."""
    import mlflow

    from training.tracking.pyfunc_model import _import_mxnet

    name, version = uri[len("models:/"):].split("/")
    # models:/ URIs resolve through the fluent registry URI: ask the server for the files' location.
    source = mlflow.MlflowClient(tracking_uri, registry_uri=tracking_uri).get_model_version_download_uri(name, version)
    local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp), tracking_uri=tracking_uri)
    found = [os.path.join(d, f) for d, _, fs in os.walk(local) for f in fs if f.endswith(".params")]
    assert len(found) == 1, found
    return [v.asnumpy() for v in _import_mxnet().nd.load(found[0]).values()]


def _same_arrays(a, b):
    """Two lists of arrays hold the same values, whatever their names (export and checkpoint name them differently)."""
    key = lambda arr: (arr.shape, float(np.abs(arr).sum()))  # noqa: E731
    a, b = sorted(a, key=key), sorted(b, key=key)
    return len(a) == len(b) and all(x.shape == y.shape and float(np.max(np.abs(x - y))) < 1e-6 for x, y in zip(a, b))


def test_both_forms_resolve_to_the_source_runs_final_checkpoint(registered, monkeypatch):
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", registered["root"])
    name = registered["name"]
    for ref in (f"models:/{name}/{registered['version']['version']}", f"models:/{name}@challenger"):
        got = _check(ref, registered["cfg"])
        assert got["run_id"] == SOURCE_RUN and got["prefix"] == registered["paths"].checkpoints, got
        assert got["step"] == got["model_step"] == registered["final_step"], got
        assert got["model"] == name and got["version"] == registered["version"]["version"], got


def test_a_job_warm_started_from_the_version_starts_from_its_parameters(registered, monkeypatch, tmp_path, caplog):
    import logging

    from training.checkpoint.store import store_for

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", registered["root"])
    warm = _check(f"models:/{registered['name']}@challenger", registered["cfg"])
    prefix = storage.join(registered["root"], "warm-run")
    job = make_job(registered["cfg"], registered["shards"], prefix, optim={"learning_rate": 1e-12})
    run_job(dataclasses.replace(job, warm_start_prefix=warm["prefix"]), prefix, tmp_path)
    assert f"warm start: parameters from step {registered['final_step']}" in caplog.text, caplog.text[-3000:]
    ckpt = store_for(job.checkpoint_prefix, job.config.checkpoint).latest()
    with np.load(io.BytesIO(ckpt.files["params.npz"])) as arrays:
        trained = [arrays[k].copy() for k in arrays.files]
    exported = _version_params(f"models:/{registered['name']}/{registered['version']['version']}", tmp_path,
                               registered["tracking_uri"])
    assert _same_arrays(trained, exported)


def test_per_step_metrics_are_in_mlflow_once_per_step_even_after_a_retry(registered):
    """The real job's per-step records (every step by default) at step=global_step; a retried
    register (same run) adds no point twice."""
    from mlflow import MlflowClient

    from training.tracking.registry import ModelRunRequest, log_model_run

    run_id = registered["version"]["run_id"]
    again = log_model_run(ModelRunRequest(run_name=f"{DAG_ID}/{SOURCE_RUN}", registered_model_name=registered["name"],
                                          tags={"airflow.dag_id": DAG_ID, "airflow.run_id": SOURCE_RUN}, run_id=run_id,
                                          **registered["common"]))
    assert again["run_id"] == run_id and again["version"] == registered["version"]["version"]
    client = MlflowClient(registered["tracking_uri"])
    for key in ("train_loss_step", "learning_rate_step"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert sorted(steps) == list(range(1, registered["final_step"] + 1)), (key, steps)
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train_loss_step")}
    assert losses[registered["final_step"]] < losses[1]  # it learned


@pytest.mark.parametrize("what", ["model", "version", "alias", "foreign"])
def test_a_missing_or_foreign_version_is_refused_readably(registered, monkeypatch, what):
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", registered["root"])
    name = registered["name"]
    ref, text = {"model": ("models:/no-such-model/1", "registered model 'no-such-model'"),
                 "version": (f"models:/{name}/99", "no version 99"),
                 "alias": (f"models:/{name}@nosuch", "no alias 'nosuch'"),
                 "foreign": (f"models:/{registered['foreign']}/1", "was not registered by this pipeline")}[what]
    with pytest.raises(AirflowFailException, match=text):
        _check(ref, registered["cfg"])


def test_through_dag_test_a_missing_version_fails_shard_without_retry(registered, mlflow_server, s3_server,
                                                                      tmp_path):
    name = registered["name"]
    env = airflow_env(str(tmp_path), **{**s3_server.env, "MXPIPE_ARTIFACT_ROOT": registered["root"],
                                        "MLFLOW_TRACKING_URI": mlflow_server.tracking_uri})
    base = {"dataset_uri": "/nonexistent/digits.csv", "recipe": "debug", "num_workers": 2}
    refs = ["models:/no-such-model/1", f"models:/{name}/99", f"models:/{name}@nosuch"]
    result, logs = run_confs(env, [{**base, "warm_start": r} for r in refs])
    for got in result["results"]:
        assert got.get("state") == "failed", got
        assert got["tasks"]["shard"] == {"state": "failed", "try_number": 1}, got["tasks"]
        for task in ("provision", "train", "register"):
            assert got["tasks"][task]["state"] in ("upstream_failed", "None"), (task, got["tasks"][task])
    for ref in refs:
        assert f"AirflowFailException: warm_start '{ref}'" in logs, logs[-3000:]
    clusters = os.path.join(str(tmp_path), "clusters")
    assert not os.path.exists(clusters) or os.listdir(clusters) == []
