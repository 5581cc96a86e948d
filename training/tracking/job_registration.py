"""Register what a DAG run's training job produced: its model, metrics, plots and data lineage.

``register_trained_job`` is the training DAG's register step without Airflow: it downloads the
job's exported model and the run's reports (the shard manifest, the validation report), draws
the training curves, reads the test split, and hands all of it to ``registry.log_model_run``
(log the DAG run's MLflow run, score the model, register it as ``challenger``). The run is the
DAG run's own (``runs.dag_run_tags`` find the one its live tracking or an earlier attempt
created), tagged with its lineage: the Airflow ids and attempt, the manifest digest, the shards
prefix (a review reads its test data from it) and the source fingerprint, the code's commit,
and the training inputs a later run is matched against (``training.tracking.reuse``).

Heavy imports (mlflow, pandas, mxnet through the model) happen inside the functions.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from common.config import TrainConfig
from training.tracking.review import SHARDS_TAG
from training.tracking.runs import PIPELINE_EXPERIMENT, dag_run_name, dag_run_tags

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainedJob:
    """A DAG run's succeeded training job, with what its upstream steps recorded."""

    config: TrainConfig
    dag_id: str
    run_id: str
    try_number: int  # the register step's own attempt
    registered_model_name: str
    tracking_uri: str
    # The shard step's pointers.
    shards_prefix: str  # its manifest is common.manifest.manifest_uri(shards_prefix)
    manifest_digest: str
    source_fingerprint: str
    # The training job's pointers and bookkeeping.
    model_prefix: str
    metrics_uri: str
    resumed_from_step: int
    train_attempts: int
    restarts: int = 0  # the job's in-place restarts of every role (training.launch.restarts)
    # The validation step's report (None or missing: not logged).
    validation_report_uri: str | None = None
    # The training inputs' tags (training.tracking.reuse.TrainingInputs.tags): a later run on the
    # same inputs finds the version by them and reuses it.
    input_tags: Mapping[str, str] = field(default_factory=dict)


def run_tags(job: TrainedJob) -> dict[str, str]:
    """The MLflow run's tags (and so every version's registered from it): the DAG run and
    attempt, the data lineage, the code's commit, the training inputs (``input_tags``)."""
    from common.version import git_sha

    return {**dag_run_tags(job.dag_id, job.run_id), "airflow.try_number": str(job.try_number),
            "dataset.manifest_digest": job.manifest_digest, "mlflow.source.git.commit": git_sha(),
            # A review reads its test data from this tag; the fingerprint names the source data.
            SHARDS_TAG: job.shards_prefix, "dataset.fingerprint": job.source_fingerprint, **job.input_tags}


def download_model(model_prefix: str, local_dir: str) -> str:
    """The exported model's files (symbol, params, meta, preprocessing) in ``local_dir``."""
    from common import storage

    for uri in storage.list_uris(model_prefix):
        storage.download_file(uri, os.path.join(local_dir, uri.rsplit("/", 1)[1]))
    return local_dir


def _download_reports(job: TrainedJob, local_dir: str) -> dict[str, str]:
    """``{artifact name: local file}`` of the shard manifest and the validation report, where they exist."""
    from common import storage
    from common.manifest import manifest_uri

    reports = {}
    for name, uri in (("manifest.json", manifest_uri(job.shards_prefix)),
                      ("validation.json", job.validation_report_uri)):
        if uri and storage.exists(uri):
            local = os.path.join(local_dir, name)
            storage.download_file(uri, local)
            reports[name] = local
    return reports


def headline_metrics(task: str, test_metrics: Mapping[str, float]) -> dict[str, float]:
    """What the register step reports of the test metrics: a regressor's RMSE and R², a
    classifier's accuracy."""
    if task == "regression":
        return {"test_rmse": test_metrics["test_rmse"], "test_r2": test_metrics["test_r2"]}
    return {"test_accuracy": test_metrics["test_accuracy"]}


def register_trained_job(job: TrainedJob) -> dict[str, Any]:
    """Log the DAG run's MLflow run, score the trained model on the test split and register it
    as ``challenger``: ``log_model_run``'s result plus ``headline_metrics``. A retry reuses the
    run (and the version, if registered). Raises ``ParamConflictError`` (a retry bringing other
    params) and ``EvaluationError`` (an unscorable test split): deterministic both."""
    from common import storage
    from common.manifest import load_manifest, manifest_uri
    from training.tracking.evaluation import load_test_split
    from training.tracking.registry import ModelRunRequest, log_model_run
    from training.tracking.run_extras import plot_artifacts
    from training.tracking.runs import find_run

    manifest = load_manifest(job.shards_prefix)
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    with tempfile.TemporaryDirectory(prefix="mxpipe-register-") as tmp:
        model_dir = download_model(job.model_prefix, os.path.join(tmp, "model"))
        artifacts = _download_reports(job, os.path.join(tmp, "extra"))
        artifacts.update(plot_artifacts(metrics["history"], os.path.join(tmp, "plots")))
        test = load_test_split(job.shards_prefix, os.path.join(tmp, "test"))
        result = log_model_run(ModelRunRequest(
            tracking_uri=job.tracking_uri, experiment=PIPELINE_EXPERIMENT,
            run_name=dag_run_name(job.dag_id, job.run_id),
            tags=run_tags(job), params={"config": job.config.to_dict(), "config_digest": job.config.digest()},
            epoch_metrics=metrics["history"],
            final_metrics={"global_step": metrics["global_step"], "resumed_from_step": job.resumed_from_step,
                           "train_attempts": job.train_attempts, "job.restarts": job.restarts},
            model_dir=model_dir, registered_model_name=job.registered_model_name,
            input_example=test.frame.head(), test_data=test, artifacts=artifacts,
            # The run this DAG run's live tracking or an earlier attempt created, reused.
            run_id=find_run(job.tracking_uri, PIPELINE_EXPERIMENT, dag_run_tags(job.dag_id, job.run_id)),
            dataset={"manifest": manifest, "manifest_uri": manifest_uri(job.shards_prefix),
                     "digest": job.manifest_digest},
            log_system_metrics=True, step_metrics=metrics.get("step_history", []), selection=metrics.get("best"),
        ))
    headline = headline_metrics(test.task, result["test_metrics"])
    log.info("registered %s version %s (%s): %s", result["registered_model_name"], result["version"],
             _described(headline), result["run_url"])
    return {**result, **headline}


def _described(headline: Mapping[str, float]) -> str:
    names = {"test_accuracy": "test accuracy", "test_rmse": "test RMSE", "test_r2": "R²"}
    return ", ".join(f"{names[key]} {value:.4f}" for key, value in headline.items())
