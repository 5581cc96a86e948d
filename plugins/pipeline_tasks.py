"""What each task of the training DAG does, in Airflow's terms. The DAG file only wires these together.

This module translates and delegates: Param values and upstream XComs come in, the work is done
by ``data_checks``, ``training``, ``infra`` and ``common``, and a small dict of pointers (URIs,
ids, digests) goes out: XCom carries pointers, never data. Heavy imports (mxnet, pandas,
great_expectations, mlflow, boto3) happen inside the functions.

S3, MLflow and the cluster backends' machines come from Airflow: every task of the DAG runs
inside its run's connections (``plugins.connections``: ``aws_default`` / ``mlflow_default`` or
the connections the ``aws_conn_id`` / ``mlflow_conn_id`` Params name, applied to the task's
environment), and the hosts and EC2 settings come from the ``mxpipe_hosts`` / ``mxpipe_ec2``
Variables, each with the environment and the settings files as the fallback.

The config is resolved once. ``shard``, the first task, turns the Params (and the file
``config_uri`` names) into the typed ``TrainConfig`` (``resolve_config``; a wrong type or an
invalid combination fails there, at once) and returns its dict beside the shard pointers; the
DAG pushes that dict as the shard task's ``config`` XCom (``CONFIG_XCOM_KEY``, about 2 KB), and
every later task rebuilds the same config from it (``load_config``) rather than deriving it
again from the Params. The Params that are not part of the config (the registered model
name, the warm start, the EC2 instance type) are read by the task that uses them.

Warm start is resolved by ``train``, for the job it starts; the shard XCom carries only shard
pointers. ``shard`` checks the reference first all the same, before anything is written or
provisioned, so a run naming a missing run, model, version or alias fails at once, not after a
cluster was provisioned for it.

Failure kinds are chosen on purpose: bad input, a failed data check, an invalid config,
invalid cluster settings, a missing or unusable connection, a warm start naming nothing usable
and a NaN loss raise ``AirflowFailException`` (no retry: the same input fails the same way); a
lost role, a stall or a storage error raise an ordinary exception, so Airflow retries the task
and the retry resumes from the latest committed checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from common import model_code
from common.config import ConfigError, TrainConfig, is_custom_model
from common.model_code import StagedCode
from common.paths import DatasetPaths, RunPaths
from common.settings import settings
from plugins import run_config
from plugins.connections import cluster_settings
from training.tracking.server import tracking_uri as mlflow_server

if TYPE_CHECKING:
    from infra.cluster import ClusterSpec

log = logging.getLogger(__name__)

EXPERIMENT = "mxnet-pipeline"
# The shard task's XCom holding the resolved config (``TrainConfig`` as a JSON-able dict).
CONFIG_XCOM_KEY = "config"
# The train task's XCom holding its live MLflow run's URL (the "MLflow run" link during training).
LIVE_RUN_XCOM_KEY = "mlflow_run_url"


def _fail(message: str) -> Exception:
    from airflow.sdk.exceptions import AirflowFailException

    return AirflowFailException(message)


def run_paths(dag_id: str, run_id: str) -> RunPaths:
    return RunPaths(root=settings().artifact_root, dag_id=dag_id, run_id=run_id)


def resolve_config(params: Mapping[str, Any]) -> TrainConfig:
    """DAG params → the one typed ``TrainConfig`` (``plugins.run_config``: recipe, config_uri,
    config, form fields). A wrong type, an unknown key or an invalid combination fails here, at
    once, without a retry."""
    try:
        return run_config.resolve(params)
    except ConfigError as exc:
        raise _fail(f"invalid configuration: {exc}") from exc


def config_xcom(cfg: TrainConfig) -> dict[str, Any]:
    """The config as its XCom carries it: JSON types only (lists, not tuples)."""
    return json.loads(cfg.to_json())


def load_config(config: Mapping[str, Any]) -> TrainConfig:
    """The config ``shard`` resolved, rebuilt from its XCom dict (validated again on the way)."""
    try:
        return TrainConfig.from_dict(dict(config))
    except ConfigError as exc:
        raise _fail(f"invalid configuration: {exc}") from exc


def shard(params: Mapping[str, Any], dag_id: str, run_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Resolve the config and shard the source: ``(config XCom, shard pointers)``."""
    from common import storage
    from common.manifest import num_outputs, read_pointer
    from data_checks.errors import DataError
    from data_checks.shard import manifest_digest, shard_content_addressed
    from training.loop.model import check_custom_model

    cfg = resolve_config(params)
    paths = run_paths(dag_id, run_id)
    # Checked before anything is written or provisioned, so a typo in the reference fails at
    # once; train resolves it again for the job it starts.
    warm_start_checkpoint(params, dag_id, run_id, cfg)
    storage.put_bytes(storage.join(paths.config, "train_config.json"), cfg.to_json().encode())
    code = stage_model_code(cfg, paths)
    dataset = DatasetPaths.for_source(paths.root, cfg.data.source_uri)
    try:
        prefix, manifest, reused = shard_content_addressed(cfg, dataset.shards)
    except DataError as exc:
        raise _fail(f"shard: {exc}") from exc
    if is_custom_model(cfg.model.name):
        _refuse_bad_config(check_custom_model, cfg, code, num_outputs(manifest), manifest["num_features"])
    pointer = read_pointer(dataset.latest_validated)
    splits = manifest["splits"]
    log.info("%s %s: %s train / %s val / %s test rows in %d train shards under %s",
             "reusing the shards of" if reused else "sharded", cfg.data.source_uri, splits["train"]["count"],
             splits["val"]["count"], splits["test"]["count"], cfg.num_train_shards, prefix)
    return config_xcom(cfg), {
        "shards_prefix": prefix, "manifest_uri": storage.join(prefix, "manifest.json"),
        "manifest_digest": manifest_digest(manifest), "num_classes": manifest["num_classes"],
        "rows": {k: v["count"] for k, v in splits.items()},
        "shard_names": [s["name"] for s in manifest["shards"]],
        "fingerprint": manifest["source_fingerprint"], "reused": reused, "dataset_root": dataset.base,
        "previous_manifest_uri": pointer["manifest_uri"] if pointer else None,
        "model_code": dataclasses.asdict(code) if code else None}


def stage_model_code(cfg: TrainConfig, paths: RunPaths) -> StagedCode | None:
    """A custom network's ``model.code_uri``, packed and staged under the run's ``code/`` with its
    sha256 (None without one), and its factory imported from the staged copy: a bad import
    path, code location or module fails here, before the data is read, without a retry."""
    from training.loop.model import check_factory

    if not is_custom_model(cfg.model.name):
        return None
    code = _refuse_bad_config(model_code.stage, cfg.model.code_uri, paths.code) if cfg.model.code_uri else None
    _refuse_bad_config(check_factory, cfg, code)
    if code:
        log.info("staged the code of %s from %s: %s (sha256 %s)", cfg.model.name, cfg.model.code_uri, code.uri,
                 code.sha256)
    return code


def _refuse_bad_config(check: Callable[..., Any], *args: Any) -> Any:
    try:
        return check(*args)
    except ConfigError as exc:
        raise _fail(f"invalid model: {exc}") from exc


def warm_start_checkpoint(params: Mapping[str, Any], dag_id: str, run_id: str,
                          cfg: TrainConfig) -> dict[str, Any] | None:
    """The ``warm_start`` Param's checkpoint as ``{"run_id", "prefix", "step"}`` (plus the version
    for a ``models:/`` reference), or None when it is empty. A reference naming nothing usable
    fails without a retry (``training.tracking.warm_start.resolve_checkpoint``)."""
    from training.checkpoint.crypto import CheckpointKeyError
    from training.tracking.warm_start import WarmStartError, resolve_checkpoint

    source = (params.get("warm_start") or "").strip()
    if not source:
        return None
    try:
        warm = resolve_checkpoint(source, dag_id=dag_id, run_id=run_id, artifact_root=settings().artifact_root,
                                  checkpoint=cfg.checkpoint, tracking_uri=mlflow_server)
    except (WarmStartError, CheckpointKeyError) as exc:  # a wrong key is configuration: no retry
        raise _fail(str(exc)) from exc
    return warm.as_dict()


def validate_shard(config: Mapping[str, Any], shards: dict[str, Any], shard_name: str, dag_id: str,
                   run_id: str) -> dict[str, Any]:
    """One mapped task per shard: its GX suite; the result goes to ``validation/shards/``."""
    from data_checks.errors import DataError
    from data_checks.report import shard_message
    from data_checks.validate import save_outcome
    from data_checks.validate import validate_shard as check_shard

    cfg = load_config(config)
    paths = run_paths(dag_id, run_id)
    try:
        # The GX Data Docs page costs about a second per shard; MXPIPE_GX_DATA_DOCS=0 skips it.
        outcome = check_shard(shards["shards_prefix"], shard_name, cfg, docs=settings().gx_data_docs)
    except DataError as exc:
        raise _fail(f"validate {shard_name}: {exc}") from exc
    result = save_outcome(outcome, paths.validation)
    if not result["success"]:
        raise _fail(shard_message(result))
    return {"shard": shard_name, "rows": result["rows"], "report_uri": result["report_uri"],
            "seconds": result["seconds"], "rows_per_s": result["rows_per_s"]}


def validate(config: Mapping[str, Any], shards: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """After every shard's task: cross-shard checks, the full report, and (on success) the
    dataset's "last validated manifest" pointer, which the next run's drift check compares to."""
    from datetime import datetime, timezone

    from common.manifest import load_manifest, write_pointer
    from data_checks.errors import DataError
    from data_checks.validate import finish_validation, load_outcome

    cfg = load_config(config)
    paths = run_paths(dag_id, run_id)
    outcomes = {name: load_outcome(paths.validation, name) for name in shards["shard_names"]}
    try:
        summary = finish_validation(shards["shards_prefix"], cfg, outcomes, report_prefix=paths.validation,
                                    previous_manifest_uri=shards.get("previous_manifest_uri"))
    except DataError as exc:
        raise _fail(f"validate: {exc}") from exc
    write_pointer(DatasetPaths(shards["dataset_root"]).latest_validated, shards["manifest_uri"],
                  load_manifest(shards["shards_prefix"]), dag_id=dag_id, run_id=run_id,
                  report_uri=summary["report_uri"],
                  validated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return {"report_uri": summary["report_uri"], "html_uri": summary["html_uri"], "evaluated": summary["evaluated"],
            "success": summary["success"], "warnings": summary["warnings"], "drift": summary["drift"],
            "manifest_digest": summary["manifest_digest"], "rows_per_s": summary["rows_per_s"]}


def cluster_spec(config: Mapping[str, Any], params: Mapping[str, Any], dag_id: str, run_id: str) -> ClusterSpec:
    """The run's ``ClusterSpec``: shape and backend from the config, machines from the backend's
    Airflow Variable or settings file (missing or malformed settings fail without a retry)."""
    from infra.cluster_settings import ClusterSettingsError
    from infra.cluster_settings import cluster_spec as spec_for

    cluster = load_config(config).cluster
    try:
        return spec_for(f"{dag_id}--{run_id}", cluster, params.get("instance_type") or "",
                        cluster_settings(cluster.backend))
    except ClusterSettingsError as exc:
        raise _fail(f"provision: {exc}") from exc


def provision(config: Mapping[str, Any], params: Mapping[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """Provision (or, on a retry, find) the run's cluster; a retry reuses what is healthy."""
    from infra.cluster import ProvisionError
    from infra.cluster import provision as provision_cluster

    spec = cluster_spec(config, params, dag_id, run_id)
    try:
        return provision_cluster(spec).describe()
    except (ProvisionError, ValueError) as exc:
        raise RuntimeError(f"provision ({spec.backend}): {exc}") from exc


def teardown(cluster: dict[str, Any] | None) -> dict[str, Any]:
    """Release the cluster (runs on success, failure and manual fail). Idempotent. A training job
    still running (the run was marked failed, the train task timed out) is stopped first, in
    order: SIGTERM to its supervisor, rank 0's emergency checkpoint, then every role."""
    from infra.cluster import attach

    if not cluster:
        log.info("nothing was provisioned; nothing to tear down")
        return {"stopped": []}
    return attach(cluster).teardown()


def reap(older_than_s: float = 0.0) -> dict[str, Any]:
    """Tear down every cluster past its TTL (``infra.cluster_settings.reap``)."""
    from infra.cluster_settings import ClusterSettingsError
    from infra.cluster_settings import reap as reap_clusters

    try:
        return reap_clusters(older_than_s, cluster_settings("ec2"))
    except ClusterSettingsError as exc:
        raise _fail(f"reap: {exc}") from exc


def live_tracking(cfg: TrainConfig, dag_id: str, run_id: str, try_number: int) -> dict[str, Any]:
    """What the job's supervisor needs to keep the DAG run's MLflow run live while it trains
    (``training.tracking.live``), or {} when ``MXPIPE_LIVE_TRACKING`` is off."""
    from common.version import git_sha

    if not settings().live_tracking:
        return {}
    return {"tracking_uri": mlflow_server(), "experiment": EXPERIMENT, "run_name": f"{dag_id}/{run_id}",
            "find_tags": {"airflow.dag_id": dag_id, "airflow.run_id": run_id},
            "tags": {"airflow.try_number": str(try_number), "mlflow.source.git.commit": git_sha()},
            "sync_s": settings().live_sync_s}


def open_live_run(job: Mapping[str, Any]) -> str:
    """Create (or find) the DAG run's MLflow run as training starts, so its link works at once;
    the supervisor's live run finds it by the same tags. '' when tracking is off or unreachable:
    MLflow never stops a training."""
    from training.tracking.live import open_run_url

    tracking = job.get("tracking") or {}
    if not tracking:
        return ""
    try:
        return open_run_url(tracking)
    except Exception as exc:  # noqa: BLE001 - tracking must not fail the training
        log.warning("could not open the MLflow run at %s: %s", tracking.get("tracking_uri"), exc)
        return ""


def prepare_job(config: Mapping[str, Any], params: Mapping[str, Any], cluster: dict[str, Any],
                shards: dict[str, Any], dag_id: str, run_id: str, try_number: int) -> dict[str, Any]:
    """Write the attempt's job document (config, where to read and write, its status record, the
    cluster its supervisor attaches to); returns the pointers the training operator keeps."""
    from common import storage
    from infra.cluster import attach
    from training.checkpoint.store import CheckpointStore
    from training.launch.job import JobSpec

    cfg = load_config(config)
    paths = run_paths(dag_id, run_id)
    # The job loads it only while this run has no checkpoint of its own (training.loop.worker).
    warm = warm_start_checkpoint(params, dag_id, run_id, cfg)
    # The cluster places the roles and picks the scheduler's address for this attempt. A retry
    # provisions again first: idempotent, it reuses what is healthy and replaces what was lost
    # (a reclaimed spot instance), where the previous attempt's failure may have come from.
    backend = attach(cluster)
    if try_number > 1:
        backend = type(backend).provision(backend.spec, backend.home)
    code = shards.get("model_code") or {}
    job = JobSpec(config=cfg, shards_prefix=shards["shards_prefix"], checkpoint_prefix=paths.checkpoints,
                  model_prefix=paths.model, metrics_uri=storage.join(paths.metrics, "train.json"),
                  run_name=f"{dag_id}/{run_id}",
                  warm_start_prefix=warm["prefix"] if warm else "",
                  model_code_uri=code.get("uri", ""), model_code_sha256=code.get("sha256", ""),
                  status_uri=paths.job_status, cluster=backend.job_cluster(),
                  tracking=live_tracking(cfg, dag_id, run_id, try_number))
    job_uri = storage.join(paths.config, "job.json")
    job.save(job_uri)
    committed = CheckpointStore(paths.checkpoints, keep=cfg.checkpoint.keep).committed_steps()
    resume_step = committed[0] if committed else 0
    log.info("attempt %d: %s", try_number,
             f"resuming from checkpoint step {resume_step}" if committed else "starting from scratch")
    return {"job_uri": job_uri, "status_uri": job.status_uri, "metrics_uri": job.metrics_uri,
            "model_prefix": paths.model, "checkpoint_prefix": paths.checkpoints, "resumed_from_step": resume_step,
            "attempt": try_number, "cluster": backend.describe(), "tracking": job.tracking}


def train_result(job: Mapping[str, Any]) -> dict[str, Any]:
    """What a succeeded training returns: the same small dict of pointers for ``register``."""
    from common import storage

    metrics = json.loads(storage.get_bytes(job["metrics_uri"]))
    return {"model_prefix": job["model_prefix"], "metrics_uri": job["metrics_uri"],
            "checkpoint_prefix": job["checkpoint_prefix"], "resumed_from_step": job["resumed_from_step"],
            "attempt": job["attempt"], "global_step": metrics["global_step"],
            "final_val_accuracy": metrics["history"][-1].get("val_accuracy"),
            # The epoch the exported model is from, when tracked (checkpoint.export_epoch, early stopping).
            "best": metrics.get("best")}


def register(config: Mapping[str, Any], params: Mapping[str, Any], shards: dict[str, Any], trained: dict[str, Any],
             validation: dict[str, Any], dag_id: str, run_id: str, try_number: int) -> dict[str, Any]:
    """Evaluate the trained model on the test split, log the run to MLflow and register a version."""
    from common import storage
    from common.version import git_sha
    from training.feed import data
    from training.tracking.evaluation import EvaluationError, load_test_split
    from training.tracking.mlflow_params import ParamConflictError
    from training.tracking.registry import ModelRunRequest, log_model_run
    from training.tracking.runs import find_run
    from training.tracking.run_extras import plot_artifacts

    cfg = load_config(config)
    manifest = data.load_manifest(shards["shards_prefix"])
    metrics = json.loads(storage.get_bytes(trained["metrics_uri"]))
    tracking_uri = mlflow_server()
    # The same tags find the run a previous attempt of this DAG run created (and reuse it).
    run_tags = {"airflow.dag_id": dag_id, "airflow.run_id": run_id}
    with tempfile.TemporaryDirectory(prefix="mxpipe-register-") as tmp:
        model_dir = os.path.join(tmp, "model")
        for uri in storage.list_uris(trained["model_prefix"]):
            storage.download_file(uri, os.path.join(model_dir, uri.rsplit("/", 1)[1]))
        extra = {}
        for name, uri in (("manifest.json", shards["manifest_uri"]),
                          ("validation.json", validation.get("report_uri"))):
            if uri and storage.exists(uri):
                local = os.path.join(tmp, "extra", name)
                storage.download_file(uri, local)
                extra[name] = local
        extra.update(plot_artifacts(metrics["history"], os.path.join(tmp, "plots")))
        try:
            test = load_test_split(shards["shards_prefix"], os.path.join(tmp, "test"))
            result = log_model_run(ModelRunRequest(
                tracking_uri=tracking_uri, experiment=EXPERIMENT, run_name=f"{dag_id}/{run_id}",
                tags={**run_tags, "airflow.try_number": str(try_number),
                      "dataset.manifest_digest": shards["manifest_digest"], "mlflow.source.git.commit": git_sha(),
                      # The review DAG reads its test data from this tag; the fingerprint names the source data.
                      "dataset.shards_prefix": shards["shards_prefix"], "dataset.fingerprint": shards["fingerprint"]},
                params={"config": cfg.to_dict(), "config_digest": cfg.digest()},
                epoch_metrics=metrics["history"],
                final_metrics={"global_step": metrics["global_step"],
                               "resumed_from_step": trained["resumed_from_step"],
                               "train_attempts": trained["attempt"]},
                model_dir=model_dir, registered_model_name=params["registered_model_name"],
                input_example=test.frame.head(), test_data=test,
                artifacts=extra, run_id=find_run(tracking_uri, EXPERIMENT, run_tags),
                dataset={"manifest": manifest, "manifest_uri": shards["manifest_uri"],
                         "digest": shards["manifest_digest"]},
                log_system_metrics=True, step_metrics=metrics.get("step_history", []),
                selection=metrics.get("best"),
            ))
        except (ParamConflictError, EvaluationError) as exc:  # conflicting params, unscorable test split: no retry
            raise _fail(str(exc)) from exc
    if test.task == "regression":
        rmse, r2 = result["test_metrics"]["test_rmse"], result["test_metrics"]["test_r2"]
        log.info("registered %s version %s (test RMSE %.4f, R² %.4f): %s", result["registered_model_name"],
                 result["version"], rmse, r2, result["run_url"])
        return {**result, "test_rmse": rmse, "test_r2": r2}
    accuracy = result["test_metrics"]["test_accuracy"]
    log.info("registered %s version %s (test accuracy %.4f): %s", result["registered_model_name"],
             result["version"], accuracy, result["run_url"])
    return {**result, "test_accuracy": accuracy}

