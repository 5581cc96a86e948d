"""What each task of the training DAG does. The DAG file only wires these together.

Every function takes plain values (Param values, small dicts from upstream XComs) and returns a
small dict of pointers (URIs, ids, digests): XCom carries pointers, never data. Heavy imports
(mxnet, pandas, great_expectations, mlflow, boto3) happen inside the functions.

Failure kinds are chosen on purpose: bad input, a failed data check, an invalid config and a
NaN loss raise ``AirflowFailException`` (no retry: the same input fails the same way); a lost
role, a stall or a storage error raise an ordinary exception, so Airflow retries the task and
the retry resumes from the latest committed checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_ARTIFACT_ROOT = "s3://mxpipe/runs"
EXPERIMENT = "mxnet-pipeline"


def _fail(message: str) -> Exception:
    from airflow.sdk.exceptions import AirflowFailException

    return AirflowFailException(message)


def artifact_root() -> str:
    return os.environ.get("MXPIPE_ARTIFACT_ROOT", DEFAULT_ARTIFACT_ROOT)


def resolve_config(params: dict[str, Any]) -> Any:
    """DAG params → the one typed ``TrainConfig`` (an invalid combination fails here, at once)."""
    from training.config import ConfigError, recipe

    try:
        base = recipe(params.get("recipe", "digits"), params["dataset_uri"])
        return base.replace(
            data={"label_column": params["label_column"]},
            model={"name": params["model"]},
            optim={"epochs": params["epochs"], "batch_size": params["batch_size"],
                   "learning_rate": params["learning_rate"], "optimizer": params["optimizer"]},
            cluster={"num_workers": params["num_workers"], "num_servers": params["num_servers"],
                     "kvstore": params["kvstore"]},
            checkpoint={"every_n_steps": params["checkpoint_every_n_steps"]},
        )
    except (ConfigError, KeyError) as exc:
        raise _fail(f"invalid configuration: {exc}") from exc


def run_paths(dag_id: str, run_id: str) -> Any:
    from common.paths import RunPaths

    return RunPaths(root=artifact_root(), dag_id=dag_id, run_id=run_id)


def shard(params: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    from common import storage
    from data_checks.errors import DataError
    from data_checks.shard import manifest_digest, shard_dataset

    cfg = resolve_config(params)
    paths = run_paths(dag_id, run_id)
    storage.put_bytes(storage.join(paths.config, "train_config.json"), cfg.to_json().encode())
    try:
        manifest = shard_dataset(cfg, paths.shards)
    except DataError as exc:
        raise _fail(f"shard: {exc}") from exc
    splits = manifest["splits"]
    log.info("sharded %s: %s train / %s val / %s test rows in %d train shards", cfg.data.source_uri,
             splits["train"]["count"], splits["val"]["count"], splits["test"]["count"], cfg.num_train_shards)
    return {"shards_prefix": paths.shards, "manifest_uri": storage.join(paths.shards, "manifest.json"),
            "manifest_digest": manifest_digest(manifest), "num_classes": manifest["num_classes"],
            "rows": {k: v["count"] for k, v in splits.items()}}


def validate(params: dict[str, Any], shards: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    from data_checks.errors import DataError
    from data_checks.validate import validate_shards

    cfg = resolve_config(params)
    paths = run_paths(dag_id, run_id)
    try:
        summary = validate_shards(shards["shards_prefix"], cfg, report_prefix=paths.validation)
    except DataError as exc:
        raise _fail(f"validate: {exc}") from exc
    return {"report_uri": summary.get("report_uri"), "evaluated": summary.get("evaluated"),
            "success": summary.get("success")}


def provision(params: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    from infra.local_cluster import ClusterSpec, LocalCluster

    cfg = resolve_config(params)
    spec = ClusterSpec(workers=cfg.cluster.num_workers, servers=cfg.cluster.num_servers,
                       run_tag=f"{dag_id}--{run_id}", backend=cfg.cluster.backend)
    return LocalCluster.provision(spec).describe()


def teardown(cluster: dict[str, Any] | None) -> dict[str, Any]:
    from infra.local_cluster import LocalCluster

    if not cluster:
        log.info("nothing was provisioned; nothing to tear down")
        return {"stopped": []}
    return {"stopped": LocalCluster.from_description(cluster).teardown()}


def train(params: dict[str, Any], cluster: dict[str, Any], shards: dict[str, Any], dag_id: str,
          run_id: str, try_number: int) -> dict[str, Any]:
    from common import storage
    from infra.local_cluster import LocalCluster
    from training.checkpoint import CheckpointStore
    from training.job import JobSpec
    from training.launcher import JobFailed, Supervisor
    from training.ports import free_port

    cfg = resolve_config(params)
    paths = run_paths(dag_id, run_id)
    job = JobSpec(config=cfg, shards_prefix=shards["shards_prefix"], checkpoint_prefix=paths.checkpoints,
                  model_prefix=paths.model, metrics_uri=storage.join(paths.metrics, "train.json"),
                  run_name=f"{dag_id}/{run_id}")
    job_uri = storage.join(paths.config, "job.json")
    job.save(job_uri)
    committed = CheckpointStore(paths.checkpoints, keep=cfg.checkpoint.keep).committed_steps()
    resume_step = committed[0] if committed else 0
    log.info("attempt %d: %s", try_number,
             f"resuming from checkpoint step {resume_step}" if committed else "starting from scratch")
    lc = LocalCluster.from_description(cluster)
    sup = Supervisor(cfg, lc.spawner(), host=lc.host, port=free_port(lc.host), base_env=os.environ)
    try:
        sup.run(job_uri)
    except JobFailed as exc:
        if exc.deterministic:
            raise _fail(f"train: {exc}") from exc
        raise
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    return {"model_prefix": paths.model, "metrics_uri": job.metrics_uri, "checkpoint_prefix": paths.checkpoints,
            "resumed_from_step": resume_step, "attempt": try_number, "global_step": metrics["global_step"],
            "final_val_accuracy": metrics["history"][-1].get("val_accuracy")}


def register(params: dict[str, Any], shards: dict[str, Any], trained: dict[str, Any], validation: dict[str, Any],
             dag_id: str, run_id: str, try_number: int) -> dict[str, Any]:
    import mlflow

    from common import storage
    from training import data
    from training.registry import evaluate_classifier, log_model_run

    cfg = resolve_config(params)
    manifest = data.load_manifest(shards["shards_prefix"])
    metrics = json.loads(storage.get_bytes(trained["metrics_uri"]))
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
    with tempfile.TemporaryDirectory(prefix="mxpipe-register-") as tmp:
        model_dir = os.path.join(tmp, "model")
        for uri in storage.list_uris(trained["model_prefix"]):
            storage.download_file(uri, os.path.join(model_dir, uri.rsplit("/", 1)[1]))
        test = [s for s in manifest["shards"] if s["split"] == "test"]
        X, y = data.fetch_split(manifest, shards["shards_prefix"], test, os.path.join(tmp, "test"))
        evaluation = evaluate_classifier(model_dir, X, y, labels="index")
        import pandas as pd

        example = pd.DataFrame(X[:5], columns=manifest["feature_columns"])
        extra = {}
        for name, uri in (("manifest.json", shards["manifest_uri"]),
                          ("validation.json", validation.get("report_uri"))):
            if uri and storage.exists(uri):
                local = os.path.join(tmp, "extra", name)
                storage.download_file(uri, local)
                extra[name] = local
        result = log_model_run(
            tracking_uri=tracking_uri, experiment=EXPERIMENT, run_name=f"{dag_id}/{run_id}",
            tags={"airflow.dag_id": dag_id, "airflow.run_id": run_id, "airflow.try_number": str(try_number),
                  "dataset.manifest_digest": shards["manifest_digest"]},
            params={"config": cfg.to_dict(), "config_digest": cfg.digest()},
            epoch_metrics=metrics["history"],
            final_metrics={"test_accuracy": evaluation["accuracy"], "global_step": metrics["global_step"],
                           "resumed_from_step": trained["resumed_from_step"],
                           "train_attempts": trained["attempt"]},
            model_dir=model_dir, registered_model_name=params["registered_model_name"], input_example=example,
            artifacts=extra, run_id=_existing_run(tracking_uri, dag_id, run_id),
        )
    log.info("registered %s version %s (test accuracy %.4f): %s", result["registered_model_name"],
             result["version"], evaluation["accuracy"], result["run_url"])
    return {**result, "test_accuracy": evaluation["accuracy"]}


def _existing_run(tracking_uri: str, dag_id: str, run_id: str) -> str | None:
    """A retried register attempt reuses the MLflow run its DAG run already created."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return None
    found = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.run_id` = '{run_id}' "
                                                                   f"and tags.`airflow.dag_id` = '{dag_id}'",
                               max_results=1)
    return found[0].info.run_id if found else None
