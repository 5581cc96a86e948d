"""Register what a DAG run's training job produced: its model, metrics, plots and data lineage.

``register_trained_job`` is the training DAG's register step without Airflow: it downloads the
job's exported model and the run's reports (the shard manifest, the validation report), draws
the training curves, reads the test split, and hands all of it to ``registry.log_model_run``
(log the DAG run's MLflow run, score the model, register it as ``challenger``). The run is the
DAG run's own (``runs.dag_run_tags`` find the one its live tracking or an earlier attempt
created), tagged with its lineage: the Airflow ids and attempt, the manifest digest, the shards
prefix (a review reads its test data from it) and the source fingerprint, the code's commit,
and the training inputs a later run is matched against (``training.tracking.reuse``).
Then the version's model card (``training.tracking.model_card``) is built from the manifest, the
config, the run's cost metrics and the champion's test metrics, and logged to the run with the
gate pending (the review adds its result).

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
    # For the model card: where the checkpoints are, the Airflow run's page, the machines.
    checkpoints_prefix: str = ""
    airflow_run_url: str = ""
    instance_type: str = ""
    model_code_sha256: str = ""  # a custom network's staged code (common.model_code.StagedCode)
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
        test = load_test_split(job.shards_prefix, os.path.join(tmp, "test"),
                               max_rows=job.config.data.evaluation_rows)
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
    card = attach_model_card(job, manifest, metrics, result)
    headline = headline_metrics(test.task, result["test_metrics"])
    log.info("registered %s version %s (%s): %s; model card %s", result["registered_model_name"], result["version"],
             _described(headline), result["run_url"], card["html"])
    return {**result, **headline, "model_card": card["html"]}


def _champion(client: Any, name: str, version: str, digest: str, metric_keys: set[str]) -> Any:
    """The ``champion`` alias's version and its run's test metrics (``model_card.Champion``)."""
    from training.tracking.model_card import Champion
    from training.tracking.review import CHAMPION_ALIAS, _alias_version

    champion = _alias_version(client, name, CHAMPION_ALIAS)
    if champion is None or champion == version:
        return Champion(None)
    mv = client.get_model_version(name, champion)
    run = client.get_run(mv.run_id) if mv.run_id else None
    metrics = {k: float(v) for k, v in (run.data.metrics if run else {}).items() if k in metric_keys}
    theirs = run.data.tags.get("dataset.manifest_digest", "") if run else ""
    basis = ("as registered, on the same test split (the same manifest)" if theirs == digest else
             f"as registered, on its own test split (manifest {theirs[:12] or 'unknown'}), not this one; "
             "the review scores both on this version's")
    return Champion(champion, metrics, basis)


def _training_facts(job: TrainedJob, metrics: Mapping[str, Any], run: Any) -> Any:
    """The card's training section: steps and time from the job's metrics file, cost from the
    run's ``cost.*`` metrics (its live tracking's), the machines from the config."""
    import time

    from training.tracking import model_card as mc
    from training.tracking.cost import PREFIX as COST_PREFIX
    from training.tracking.registry import selection_tags

    cluster, history = job.config.cluster, metrics.get("history", [])
    # The run opened when training started (its live tracking), or at registration.
    wall = max(time.time() - run.info.start_time / 1000, 0.0) if run.info.start_time else None
    return mc.Training(
        global_step=int(metrics.get("global_step", 0)), epochs=len(history), loop_seconds=mc.loop_seconds(history),
        wall_seconds=wall, attempts=job.train_attempts, restarts=job.restarts,
        resumed_from_step=job.resumed_from_step, backend=cluster.backend, num_workers=cluster.num_workers,
        num_servers=cluster.num_servers, device=cluster.device, devices_per_worker=cluster.devices_per_worker,
        instance_type=job.instance_type,
        cost={k: float(v) for k, v in run.data.metrics.items() if k.startswith(COST_PREFIX)},
        selection=selection_tags(metrics.get("best")))


def attach_model_card(job: TrainedJob, manifest: Mapping[str, Any], metrics: Mapping[str, Any],
                      result: Mapping[str, Any]) -> dict[str, str]:
    """Build the registered version's model card (gate pending) and log it to its run
    (``model_card.log_card``); returns its artifact paths and summary. A retry logs the same
    paths again."""
    import time

    from common.manifest import manifest_uri
    from training.tracking import model_card as mc
    from training.tracking.registry import logged_model_id
    from training.tracking.review import client as mlflow_client
    from training.tracking.runs import bounded_mlflow_env

    started = time.monotonic()
    name, version, rid = result["registered_model_name"], str(result["version"]), result["run_id"]
    cfg = job.config
    with bounded_mlflow_env():
        client = mlflow_client(job.tracking_uri)
        mv = client.get_model_version(name, version)
        run = client.get_run(rid)
        test_metrics = {k: float(v) for k, v in result["test_metrics"].items()}
        card = mc.ModelCard(
            name=name, version=version, created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            data=mc.data_facts(manifest, manifest_uri=manifest_uri(job.shards_prefix), digest=job.manifest_digest),
            config=json.loads(cfg.to_json()), config_digest=cfg.digest(),
            git_commit=run.data.tags.get("mlflow.source.git.commit", ""), model_code_sha256=job.model_code_sha256,
            model_sha256=mv.tags.get("model_sha256", ""), test_metrics=test_metrics,
            champion=_champion(client, name, version, job.manifest_digest, set(test_metrics)),
            gate=mc.Gate(mc.GATE_PENDING), training=_training_facts(job, metrics, run),
            lineage=mc.Lineage(dag_id=job.dag_id, run_id=job.run_id, airflow_run_url=job.airflow_run_url,
                               mlflow_run_id=rid, mlflow_run_url=result["run_url"],
                               checkpoints_prefix=job.checkpoints_prefix, model_prefix=job.model_prefix,
                               shards_prefix=job.shards_prefix, logged_model_id=logged_model_id(mv) or ""))
        logged = mc.log_card(client, card, rid, mc.REGISTERED)
        # The version's page shows its description: it names the card too (once: a retry finds it there).
        description = mv.description or ""
        if "Model card:" not in description:
            client.update_model_version(name, version, description=f"{description}\n\nModel card: "
                                                                     f"`runs:/{rid}/{logged['html']}`".strip())
    log.info("model card of %s version %s logged to run %s in %.1f s", name, version, rid, time.monotonic() - started)
    return logged


def _described(headline: Mapping[str, float]) -> str:
    names = {"test_accuracy": "test accuracy", "test_rmse": "test RMSE", "test_r2": "R²"}
    return ", ".join(f"{names[key]} {value:.4f}" for key, value in headline.items())
