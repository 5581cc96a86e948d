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
    from common.config import ConfigError, recipe

    try:
        base = recipe(params.get("recipe", "digits"), params["dataset_uri"])
        return base.replace(
            # data_options: further data.* fields (id_column, classes, drift_action, ...) as a JSON object.
            data={"label_column": params["label_column"], **(params.get("data_options") or {})},
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


# Content-addressed shards and the "last validated manifest" pointer live per dataset here.
DATASETS_DIR = "datasets"
LATEST_VALIDATED = "latest_validated.json"


def dataset_root(source_uri: str) -> str:
    """``{artifact_root}/datasets/{name}-{hash8}``: one folder per source URI.

    Shards are a function of the data (``shards/{fingerprint[:16]}``), not of the run: a run on
    unchanged data finds the shards a previous run made and reuses them; changed data or
    settings get a new prefix. The pointer to the last validated manifest sits beside them.
    """
    import hashlib

    from common import storage
    from common.paths import safe_component

    tail = [p for p in source_uri.replace("*", "_").split("/") if p]
    name = safe_component(tail[-1] if tail else "dataset")[:60] or "dataset"
    return storage.join(artifact_root(), DATASETS_DIR, f"{name}-{hashlib.sha256(source_uri.encode()).hexdigest()[:8]}")


def shard(params: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    from common import storage
    from common.manifest import read_pointer
    from data_checks.errors import DataError
    from data_checks.shard import manifest_digest, shard_content_addressed

    cfg = resolve_config(params)
    paths = run_paths(dag_id, run_id)
    # Checked before anything is written or provisioned: a typo in the run id fails at once.
    warm = warm_start_checkpoint(params, dag_id, run_id, cfg)
    storage.put_bytes(storage.join(paths.config, "train_config.json"), cfg.to_json().encode())
    root = dataset_root(cfg.data.source_uri)
    try:
        prefix, manifest, reused = shard_content_addressed(cfg, storage.join(root, "shards"))
    except DataError as exc:
        raise _fail(f"shard: {exc}") from exc
    pointer = read_pointer(storage.join(root, LATEST_VALIDATED))
    splits = manifest["splits"]
    log.info("%s %s: %s train / %s val / %s test rows in %d train shards under %s",
             "reusing the shards of" if reused else "sharded", cfg.data.source_uri, splits["train"]["count"],
             splits["val"]["count"], splits["test"]["count"], cfg.num_train_shards, prefix)
    return {"shards_prefix": prefix, "manifest_uri": storage.join(prefix, "manifest.json"),
            "manifest_digest": manifest_digest(manifest), "num_classes": manifest["num_classes"],
            "rows": {k: v["count"] for k, v in splits.items()},
            "shard_names": [s["name"] for s in manifest["shards"]],
            "fingerprint": manifest["source_fingerprint"], "reused": reused, "dataset_root": root,
            "previous_manifest_uri": pointer["manifest_uri"] if pointer else None, "warm_start": warm}


def warm_start_checkpoint(params: dict[str, Any], dag_id: str, run_id: str, cfg: Any) -> dict[str, Any] | None:
    """The ``warm_start`` run's newest valid checkpoint as ``{"run_id", "prefix", "step"}``, or None.

    ``warm_start`` is a run id of this DAG, or a registered version (``models:/name/3``,
    ``models:/name@alias``: its training run, from the version's tags, ``training.tracking.warm_start``;
    the result then also names the version). Only an explicitly named run is used: a new DAG
    run never picks up another run's checkpoints by itself. A missing run, model, version or
    alias, or one with no checkpoint that verifies, fails without a retry.
    """
    from training.checkpoint.store import CorruptCheckpoint, store_for
    from training.tracking.warm_start import is_model_uri

    source = (params.get("warm_start") or "").strip()
    if not source:
        return None
    model = _warm_start_model(source) if is_model_uri(source) else None
    source_dag, source_run = (model.dag_id, model.run_id) if model else (dag_id, source)
    if (source_dag, source_run) == (dag_id, run_id):
        raise _fail(f"warm_start {source!r} is this run itself; a retry resumes its own checkpoints anyway")
    prefix = run_paths(source_dag, source_run).checkpoints
    try:
        ckpt = store_for(prefix, cfg.checkpoint).latest()
    except CorruptCheckpoint as exc:
        raise _fail(f"warm_start {source!r}: no valid checkpoint under {prefix}: {exc}") from exc
    if ckpt is None:
        raise _fail(f"warm_start {source!r}: no run of {source_dag} with a committed checkpoint under {prefix} "
                    "(is the run id right?)")
    if model and model.step is not None and ckpt.step != model.step:
        # The worker loads the newest checkpoint under the prefix: it must be the version's.
        raise _fail(f"warm_start {source!r}: the newest valid checkpoint of run {source_run} is step {ckpt.step}, "
                    f"but version {model.version} was logged at step {model.step}")
    log.info("warm start from %s step %d (%s)", source, ckpt.step, prefix)
    return {"run_id": source_run, "prefix": prefix, "step": ckpt.step, **(model.as_dict() if model else {})}


def _warm_start_model(source: str) -> Any:
    """The registered version ``source`` names; a missing one fails without a retry."""
    import mlflow

    from training.tracking.warm_start import WarmStartError, resolve_model

    try:
        return resolve_model(source, os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri())
    except WarmStartError as exc:
        raise _fail(str(exc)) from exc


def validate_shard(params: dict[str, Any], shards: dict[str, Any], shard_name: str, dag_id: str,
                   run_id: str) -> dict[str, Any]:
    """One mapped task per shard: its GX suite; the result goes to ``validation/shards/``."""
    from data_checks.errors import DataError
    from data_checks.report import shard_message
    from data_checks.validate import save_outcome
    from data_checks.validate import validate_shard as check_shard

    cfg = resolve_config(params)
    paths = run_paths(dag_id, run_id)
    try:
        # The GX Data Docs page costs about a second per shard; MXPIPE_GX_DATA_DOCS=0 skips it.
        outcome = check_shard(shards["shards_prefix"], shard_name, cfg,
                              docs=os.environ.get("MXPIPE_GX_DATA_DOCS", "1") != "0")
    except DataError as exc:
        raise _fail(f"validate {shard_name}: {exc}") from exc
    result = save_outcome(outcome, paths.validation)
    if not result["success"]:
        raise _fail(shard_message(result))
    return {"shard": shard_name, "rows": result["rows"], "report_uri": result["report_uri"],
            "seconds": result["seconds"], "rows_per_s": result["rows_per_s"]}


def validate(params: dict[str, Any], shards: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """After every shard's task: cross-shard checks, the full report, and (on success) the
    dataset's "last validated manifest" pointer, which the next run's drift check compares to."""
    from datetime import datetime, timezone

    from common import storage
    from common.manifest import load_manifest, write_pointer
    from data_checks.errors import DataError
    from data_checks.validate import finish_validation, load_outcome

    cfg = resolve_config(params)
    paths = run_paths(dag_id, run_id)
    outcomes = {name: load_outcome(paths.validation, name) for name in shards["shard_names"]}
    try:
        summary = finish_validation(shards["shards_prefix"], cfg, outcomes, report_prefix=paths.validation,
                                    previous_manifest_uri=shards.get("previous_manifest_uri"))
    except DataError as exc:
        raise _fail(f"validate: {exc}") from exc
    write_pointer(storage.join(shards["dataset_root"], LATEST_VALIDATED), shards["manifest_uri"],
                  load_manifest(shards["shards_prefix"]), dag_id=dag_id, run_id=run_id,
                  report_uri=summary["report_uri"],
                  validated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return {"report_uri": summary["report_uri"], "html_uri": summary["html_uri"], "evaluated": summary["evaluated"],
            "success": summary["success"], "warnings": summary["warnings"], "drift": summary["drift"],
            "manifest_digest": summary["manifest_digest"], "rows_per_s": summary["rows_per_s"]}


def cluster_options(backend: str) -> dict[str, Any]:
    """Where a backend's machines are, from the environment of the Airflow workers.

    ``MXPIPE_HOSTS_FILE``: a JSON list of hosts (``infra.transport.HostSpec`` fields) for the
    ``hosts`` backend. ``MXPIPE_EC2_FILE``: a JSON object of ``infra.ec2_cluster.Ec2Options``
    fields (region, launch template, subnet, spot, ...) for the ``ec2`` backend.
    """
    if backend == "local":
        return {}
    var = {"hosts": "MXPIPE_HOSTS_FILE", "ec2": "MXPIPE_EC2_FILE"}[backend]
    path = os.environ.get(var)
    if not path:
        raise _fail(f"backend {backend!r} needs {var} (a JSON file describing its machines)")
    with open(path) as fh:
        raw = json.load(fh)
    return {"hosts": raw} if backend == "hosts" else raw


def cluster_spec(params: dict[str, Any], dag_id: str, run_id: str) -> Any:
    """The run's ``ClusterSpec``: shape from the config, place from the ``backend`` param."""
    from infra.cluster import ClusterSpec

    cfg = resolve_config(params)
    backend = params.get("backend") or "local"
    options = cluster_options(backend)
    return ClusterSpec(run_tag=f"{dag_id}--{run_id}", workers=cfg.cluster.num_workers,
                       servers=cfg.cluster.num_servers, backend=backend,
                       devices_per_worker=int(options.get("devices_per_worker", 0)),
                       instance_type=str(params.get("instance_type") or options.get("instance_type", "")), image=str(options.get("image", "")),
                       ttl_s=float(os.environ.get("MXPIPE_CLUSTER_TTL_S", 6 * 3600)), options=options)


def provision(params: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """Provision (or, on a retry, find) the run's cluster; a retry reuses what is healthy."""
    from infra.cluster import ProvisionError
    from infra.cluster import provision as provision_cluster

    spec = cluster_spec(params, dag_id, run_id)
    try:
        return provision_cluster(spec).describe()
    except (ProvisionError, ValueError) as exc:
        raise RuntimeError(f"provision ({spec.backend}): {exc}") from exc


def teardown(cluster: dict[str, Any] | None) -> dict[str, Any]:
    """Release the cluster (runs on success, failure and manual fail). Idempotent."""
    from infra.cluster import attach

    if not cluster:
        log.info("nothing was provisioned; nothing to tear down")
        return {"stopped": []}
    return attach(cluster).teardown()


def reap(older_than_s: float = 0.0) -> dict[str, Any]:
    """Tear down every cluster past its TTL: local records, and EC2 instances by their tags."""
    from infra.cluster import reap as reap_records

    reaped = {"clusters": reap_records(older_than_s)}
    if os.environ.get("MXPIPE_EC2_FILE"):
        from infra.ec2_cluster import Ec2Options, reap_expired

        reaped["ec2_instances"] = reap_expired(Ec2Options.from_dict(cluster_options("ec2")),
                                               older_than_s=older_than_s)
    log.info("reaper: %s", reaped)
    return reaped


def train(params: dict[str, Any], cluster: dict[str, Any], shards: dict[str, Any], dag_id: str,
          run_id: str, try_number: int) -> dict[str, Any]:
    from common import storage
    from infra.cluster import attach
    from training.checkpoint.store import CheckpointStore
    from training.launch.job import JobSpec
    from training.launch.launcher import JobFailed, Supervisor

    cfg = resolve_config(params)
    paths = run_paths(dag_id, run_id)
    job = JobSpec(config=cfg, shards_prefix=shards["shards_prefix"], checkpoint_prefix=paths.checkpoints,
                  model_prefix=paths.model, metrics_uri=storage.join(paths.metrics, "train.json"),
                  run_name=f"{dag_id}/{run_id}",
                  warm_start_prefix=(shards.get("warm_start") or {}).get("prefix", ""))
    job_uri = storage.join(paths.config, "job.json")
    job.save(job_uri)
    committed = CheckpointStore(paths.checkpoints, keep=cfg.checkpoint.keep).committed_steps()
    resume_step = committed[0] if committed else 0
    log.info("attempt %d: %s", try_number,
             f"resuming from checkpoint step {resume_step}" if committed else "starting from scratch")
    # The cluster places the roles and picks the scheduler's address for this attempt. A retry
    # provisions again first: idempotent, it reuses what is healthy and replaces what was lost
    # (a reclaimed spot instance), where the previous attempt's failure may have come from.
    backend = attach(cluster)
    if try_number > 1:
        backend = type(backend).provision(backend.spec, backend.home)
    sup = Supervisor(cfg, cluster=backend, base_env=os.environ)
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
    from training.feed import data
    from training.tracking.evaluation import evaluate_classifier
    from training.tracking.registry import log_model_run
    from training.tracking.run_extras import plot_artifacts

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
        extra.update(plot_artifacts(metrics["history"], evaluation, os.path.join(tmp, "plots")))
        result = log_model_run(
            tracking_uri=tracking_uri, experiment=EXPERIMENT, run_name=f"{dag_id}/{run_id}",
            tags={"airflow.dag_id": dag_id, "airflow.run_id": run_id, "airflow.try_number": str(try_number),
                  "dataset.manifest_digest": shards["manifest_digest"], "mlflow.source.git.commit": git_sha(),
                  # The review DAG reads its test data from this tag; the fingerprint names the source data.
                  "dataset.shards_prefix": shards["shards_prefix"], "dataset.fingerprint": shards["fingerprint"]},
            params={"config": cfg.to_dict(), "config_digest": cfg.digest()},
            epoch_metrics=metrics["history"],
            final_metrics={"test_accuracy": evaluation["accuracy"], "global_step": metrics["global_step"],
                           "resumed_from_step": trained["resumed_from_step"],
                           "train_attempts": trained["attempt"]},
            model_dir=model_dir, registered_model_name=params["registered_model_name"], input_example=example,
            artifacts=extra, run_id=_existing_run(tracking_uri, dag_id, run_id),
            dataset={"manifest": manifest, "manifest_uri": shards["manifest_uri"],
                     "digest": shards["manifest_digest"]},
            log_system_metrics=True, step_metrics=metrics.get("step_history", []),
        )
    log.info("registered %s version %s (test accuracy %.4f): %s", result["registered_model_name"],
             result["version"], evaluation["accuracy"], result["run_url"])
    return {**result, "test_accuracy": evaluation["accuracy"]}


def git_sha() -> str:
    """The code version that trained the model: ``MXPIPE_GIT_SHA`` (set in images, which carry
    no .git), else ``git rev-parse HEAD`` of this checkout, else "unknown"."""
    import subprocess

    if sha := os.environ.get("MXPIPE_GIT_SHA"):
        return sha
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


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
