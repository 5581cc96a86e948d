"""What each task of the training DAG does, in Airflow's terms. The DAG file only wires these together.

This module only translates: Param values and upstream XComs come in and become the arguments
of a domain function (``data_checks.parts``' ``plan`` / ``count`` / ``shard_part`` / ``merge``, ``data_checks.validate``'s
``validate_run_shard`` / ``finish_run_validation``, ``infra.cluster``,
``training.train_job.prepare_attempt``, ``training.tracking.job_registration.register_trained_job``),
its deterministic errors become a failure without a retry (``plugins.failures``), and a small
dict of pointers (URIs, ids, digests) goes out: XCom carries pointers, never data. ``shard`` and
``shard_merge`` call several, in order, as their work spans ``training`` and ``data_checks``,
which never import each other. Heavy imports (mxnet, pandas, great_expectations, mlflow, boto3)
happen inside the functions.

S3, MLflow and the cluster backends' machines come from Airflow: every task of the DAG runs
inside its run's connections (``plugins.connections``: ``aws_default`` / ``mlflow_default`` or
the connections the ``aws_conn_id`` / ``mlflow_conn_id`` Params name, applied to the task's
environment), and the hosts and EC2 settings come from the ``mxpipe_hosts`` / ``mxpipe_ec2``
Variables, each with the environment and the settings files as the fallback.

The config is resolved once. ``shard``, the first task, turns the Params (and the file
``config_uri`` names) into the typed ``TrainConfig`` (``resolve_config``; a wrong type or an
invalid combination fails there, at once) and returns its dict beside the sharding plan; the
DAG pushes that dict as the shard task's ``config`` XCom (``CONFIG_XCOM_KEY``, about 2 KB), and
every later task rebuilds the same config from it (``load_config``) rather than deriving it
again from the Params. The Params that are not part of the config (the registered model
name, the warm start, the EC2 instance type, the number of shard parts) are read by the task
that uses them.

Sharding is four steps (``data_checks.parts``): ``shard`` plans it (and finds unchanged shards to
reuse), ``shard_count`` and ``shard_part`` run once per part of the source as mapped tasks, and
``shard_merge`` assembles the shards, commits the manifest and returns the shard pointers every
later task reads (``shard_in_process`` runs the four in one process).

The warm start is resolved once per run, by ``check_reuse``: the checkpoint it resolves to is
one of the run's training inputs, and the same resolution goes to ``train`` (the
``WARM_START_XCOM_KEY`` XCom, the operator's templated ``warm_start``), whose every attempt
loads it; resolving again there could load another checkpoint than the one the reuse decision
and the registered version's input tags name (a ``models:/…@alias`` moved in between). A
sweep resolves it once as well, in ``plan_trials`` (``plugins.sweep_tasks``): every trial
carries that resolution to its train task, and ``select_best`` puts it in the inputs the
registered version is tagged with. ``shard`` checks
the reference first all the same, before anything is written or provisioned, so a run naming
a missing run, model, version or alias fails at once, not after a cluster was provisioned for it.

Unchanged inputs are not trained again: ``check_reuse`` (after validation, before anything is
provisioned) finds a version an earlier successful run registered from the same training
inputs (``training.tracking.reuse``), and ``reuse`` records its reuse in MLflow; ``register``
tags every version it registers with its inputs.

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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from common.config import ConfigError, TrainConfig
from common.paths import DatasetPaths, RunPaths
from common.settings import settings
from plugins import run_config
from plugins.connections import cluster_settings
from plugins.failures import fail_without_retry

if TYPE_CHECKING:
    from infra.cluster import ClusterSpec

log = logging.getLogger(__name__)

# The shard task's XCom holding the resolved config (``TrainConfig`` as a JSON-able dict).
CONFIG_XCOM_KEY = "config"
# The train task's XCom holding its live MLflow run's URL (the "MLflow run" link during training).
LIVE_RUN_XCOM_KEY = "mlflow_run_url"
# The reuse check's XComs: the run's training inputs (``TrainingInputs`` as a dict) and the
# earlier version it reuses (``Reusable`` as a dict; None: the run trains).
INPUTS_XCOM_KEY = "inputs"
REUSABLE_XCOM_KEY = "reusable"
# The reuse check's XCom of the warm start it resolved ({"reference", "checkpoint"}), which the
# train task's every attempt loads: the run resolves its warm start once.
WARM_START_XCOM_KEY = "warm_start"


def run_paths(dag_id: str, run_id: str) -> RunPaths:
    return RunPaths(root=settings().artifact_root, dag_id=dag_id, run_id=run_id)


def resolve_config(params: Mapping[str, Any]) -> TrainConfig:
    """DAG params → the one typed ``TrainConfig`` (``plugins.run_config``: recipe, config_uri,
    config, form fields). A wrong type, an unknown key or an invalid combination fails here, at
    once, without a retry."""
    try:
        return run_config.resolve(params)
    except ConfigError as exc:
        raise fail_without_retry(f"invalid configuration: {exc}") from exc


def config_xcom(cfg: TrainConfig) -> dict[str, Any]:
    """The config as its XCom carries it: JSON types only (lists, not tuples)."""
    return json.loads(cfg.to_json())


def load_config(config: Mapping[str, Any]) -> TrainConfig:
    """The config ``shard`` resolved, rebuilt from its XCom dict (validated again on the way)."""
    try:
        return TrainConfig.from_dict(dict(config))
    except ConfigError as exc:
        raise fail_without_retry(f"invalid configuration: {exc}") from exc


def _refuse_bad_model(check: Callable[..., Any], *args: Any) -> Any:
    try:
        return check(*args)
    except ConfigError as exc:
        raise fail_without_retry(f"invalid model: {exc}") from exc


def shard(params: Mapping[str, Any], dag_id: str, run_id: str,
          sweep_cap: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Resolve the config and plan the sharding: ``(config XCom, plan)``. In order: the warm
    start is checked (before anything is written or provisioned, so a typo in the reference fails
    at once; ``check_reuse`` resolves it for the run), the config and a custom network's
    code are staged (``training.train_job.stage_run``), and the sharding is planned
    (``data_checks.parts.plan``: reuse of unchanged shards, the source's columns, the parts, whose
    number is the ``shard_parts`` Param, else ``MXPIPE_SHARD_PARTS``, else one per 256 MB).

    ``sweep_cap``: the run is a sweep (the sweep DAG, at most that many trials at once): its
    trials are planned and checked first (``plugins.sweep_tasks.check_sweep``), so a bad sweep
    fails before anything is sharded. Without it, a config with a sweep section is refused: the
    training DAG would train the base config and ignore the sweep."""
    import hashlib

    from data_checks import parts
    from data_checks.errors import DataError
    from training.train_job import stage_run

    cfg = resolve_config(params)
    if sweep_cap is not None:
        from plugins.sweep_tasks import check_sweep

        check_sweep(config_xcom(cfg), sweep_cap)
    elif cfg.sweep is not None:
        raise fail_without_retry("invalid configuration: the config has a sweep section; trigger the mxnet_sweep "
                                 "DAG to run a sweep (this DAG trains one config)")
    paths = run_paths(dag_id, run_id)
    warm_start_checkpoint(params, dag_id, run_id, cfg)
    code = _refuse_bad_model(stage_run, cfg, paths)
    dataset = DatasetPaths.for_source(paths.root, cfg.data.source_uri)
    # The run's folder of intermediate parts, the same for a retry of this task.
    token = hashlib.sha256(f"{dag_id}/{run_id}".encode()).hexdigest()[:12]
    try:
        planned = parts.plan(cfg, dataset.shards, int(params.get("shard_parts") or settings().shard_parts), token)
    except DataError as exc:
        raise fail_without_retry(f"shard: {exc}") from exc
    return config_xcom(cfg), {**planned, "model_code": dataclasses.asdict(code) if code else None}


@contextmanager
def _refuse_bad_data(step: str) -> Iterator[None]:
    """A data error fails the task without a retry (the same input fails the same way)."""
    from data_checks.errors import DataError

    try:
        yield
    except DataError as exc:
        raise fail_without_retry(f"{step}: {exc}") from exc


def shard_count(config: Mapping[str, Any], planned: Mapping[str, Any], part: int) -> str:
    """One mapped task per part: its counts (``data_checks.parts.count``); returns their URI."""
    from data_checks import parts

    with _refuse_bad_data(f"shard_count {part}"):
        return parts.count(load_config(config), planned["plan_uri"], part)


def shard_part(config: Mapping[str, Any], planned: Mapping[str, Any], part: int) -> str:
    """One mapped task per part: its pieces of every shard (``data_checks.parts.shard_part``)."""
    from data_checks import parts

    with _refuse_bad_data(f"shard_part {part}"):
        return parts.shard_part(load_config(config), planned["plan_uri"], part)


def shard_merge(config: Mapping[str, Any], planned: Mapping[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """The shards from the parts, the manifest committed last (``data_checks.parts.merge``), or
    the reused shards, or (an image folder) the shards of one pass; a custom network is then built
    for their shape. Returns the shard pointers the later tasks read."""
    from common.manifest import load_manifest
    from common.model_code import StagedCode
    from data_checks import parts
    from data_checks.shard import run_pointers, shard_content_addressed
    from training.train_job import check_model_fits

    cfg = load_config(config)
    dataset = DatasetPaths.for_source(run_paths(dag_id, run_id).root, cfg.data.source_uri)
    with _refuse_bad_data("shard_merge"):
        if planned["reused"]:
            prefix, manifest, reused = planned["prefix"], load_manifest(planned["prefix"]), True
        elif not planned["parts"]:  # an image folder: one pass
            prefix, manifest, reused = shard_content_addressed(cfg, dataset.shards)
        else:
            prefix, manifest, reused = planned["prefix"], parts.merge(cfg, planned["plan_uri"]), False
    code = StagedCode(**planned["model_code"]) if planned.get("model_code") else None
    _refuse_bad_model(check_model_fits, cfg, code, manifest)
    return {**run_pointers(cfg, dataset, prefix, manifest, reused), "model_code": planned.get("model_code"),
            "parts": len(planned["parts"])}


def warm_start_checkpoint(params: Mapping[str, Any], dag_id: str, run_id: str,
                          cfg: TrainConfig) -> dict[str, Any] | None:
    """The ``warm_start`` Param's checkpoint as ``{"run_id", "prefix", "step"}`` (plus the version
    for a ``models:/`` reference), or None when it is empty. A reference naming nothing usable
    fails without a retry (``training.train_job.resolve_warm_start``)."""
    from training.train_job import resolve_warm_start

    with _refuse_bad_warm_start():
        return resolve_warm_start(params.get("warm_start") or "", run_paths(dag_id, run_id), cfg)


def resolve_run_warm_start(params: Mapping[str, Any], dag_id: str, run_id: str, cfg: TrainConfig) -> dict[str, Any]:
    """The run's one resolution of its warm start, as ``train`` takes it: ``{"reference" (the
    Param), "checkpoint" (``warm_start_checkpoint``: None without one)}``. Made once per DAG run
    (``check_reuse``; a sweep's ``plan_trials``), never per attempt: a ``models:/…@alias`` may
    move in between."""
    return {"reference": params.get("warm_start") or "",
            "checkpoint": warm_start_checkpoint(params, dag_id, run_id, cfg)}


@contextmanager
def _refuse_bad_warm_start() -> Iterator[None]:
    """A warm start naming nothing usable, or a wrong checkpoint key, fails without a retry."""
    from training.checkpoint.crypto import CheckpointKeyError
    from training.tracking.warm_start import WarmStartError

    try:
        yield
    except (WarmStartError, CheckpointKeyError) as exc:  # a wrong key is configuration: no retry
        raise fail_without_retry(str(exc)) from exc


def check_reuse(config: Mapping[str, Any], params: Mapping[str, Any], shards: dict[str, Any], dag_id: str,
                run_id: str) -> dict[str, Any]:
    """The run's training inputs and the registered version an earlier successful run trained on
    the same ones (``training.tracking.reuse.find_reusable``): ``{"inputs", "reusable", "reason",
    "warm_start"}``, ``reusable`` None when the run must train (no match, or the ``force`` Param).
    The inputs: the manifest digest and custom network code the shard task recorded, the config's
    ``model_digest`` and the checkpoint the warm start resolves to now (a ``models:/…@alias``
    whose alias moved is another input). ``warm_start`` is that resolution (``{"reference",
    "checkpoint"}``), the one ``train`` loads (``prepare_job``)."""
    from training.loop.resume import model_digest
    from training.tracking.reuse import TrainingInputs, find_reusable
    from training.tracking.server import tracking_uri

    cfg = load_config(config)
    code = shards.get("model_code") or {}
    warm = resolve_run_warm_start(params, dag_id, run_id, cfg)
    inputs = TrainingInputs.of(shards["manifest_digest"], model_digest(cfg), code.get("sha256"), warm["checkpoint"])
    name = params["registered_model_name"]
    search = find_reusable(tracking_uri(), name, inputs)
    reason = search.explain(inputs, name)
    reusable = search.match
    if reusable is not None and params.get("force"):
        reason, reusable = f"{reason}; the force Param is set: training anyway", None
    log.info("%s; %s", reason, "reusing it: provision and train are skipped (the force Param trains anyway)"
             if reusable is not None else "training")
    return {"inputs": dataclasses.asdict(inputs), "reason": reason,
            "reusable": dataclasses.asdict(reusable) if reusable is not None else None,
            "warm_start": warm}


def reuse(inputs: Mapping[str, Any], reusable: Mapping[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """Record that this run reuses an earlier run's version (``training.tracking.reuse.record_reuse``):
    the version, its model URI and metrics, and which DAG run trained it."""
    from training.tracking.reuse import Reusable, TrainingInputs, record_reuse
    from training.tracking.server import tracking_uri

    return record_reuse(tracking_uri(), Reusable(**reusable), TrainingInputs(**inputs), dag_id, run_id)


def validate_shard(config: Mapping[str, Any], shards: dict[str, Any], shard_name: str, dag_id: str,
                   run_id: str) -> dict[str, Any]:
    """One mapped task per shard: its GX suite; the result goes to ``validation/shards/``."""
    from data_checks.errors import DataError
    from data_checks.report import shard_message
    from data_checks.validate import validate_run_shard

    try:
        # The GX Data Docs page costs about a second per shard; MXPIPE_GX_DATA_DOCS=0 skips it.
        result = validate_run_shard(shards["shards_prefix"], shard_name, load_config(config),
                                    run_paths(dag_id, run_id).validation, docs=settings().gx_data_docs)
    except DataError as exc:
        raise fail_without_retry(f"validate {shard_name}: {exc}") from exc
    if not result["success"]:
        raise fail_without_retry(shard_message(result))
    return {"shard": shard_name, "rows": result["rows"], "report_uri": result["report_uri"],
            "seconds": result["seconds"], "rows_per_s": result["rows_per_s"]}


def validate(config: Mapping[str, Any], shards: dict[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """After every shard's task: cross-shard checks, the full report, and (on success) the
    dataset's "last validated manifest" pointer, which the next run's drift check compares to."""
    from data_checks.errors import DataError
    from data_checks.validate import finish_run_validation

    try:
        summary = finish_run_validation(
            shards["shards_prefix"], load_config(config), shards["shard_names"],
            report_prefix=run_paths(dag_id, run_id).validation,
            latest_validated_uri=DatasetPaths(shards["dataset_root"]).latest_validated,
            previous_manifest_uri=shards.get("previous_manifest_uri"), dag_id=dag_id, run_id=run_id)
    except DataError as exc:
        raise fail_without_retry(f"validate: {exc}") from exc
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
        raise fail_without_retry(f"provision: {exc}") from exc


def provision(config: Mapping[str, Any], params: Mapping[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """Provision (or, on a retry, find) the run's cluster; a retry reuses what is healthy."""
    from infra.cluster import ProvisionError
    from infra.cluster import provision as provision_cluster

    spec = cluster_spec(config, params, dag_id, run_id)
    if spec.backend == "local":
        _refuse_local_across_workers()
    try:
        return provision_cluster(spec).describe()
    except (ProvisionError, ValueError) as exc:
        raise RuntimeError(f"provision ({spec.backend}): {exc}") from exc


def _refuse_local_across_workers() -> None:
    """The local backend under an executor whose tasks may run on other hosts fails without a
    retry (``infra.local_cluster.refuse_across_hosts``): it would half-work."""
    from airflow.sdk.configuration import conf

    from infra.cluster import ProvisionError
    from infra.local_cluster import refuse_across_hosts

    try:
        refuse_across_hosts(conf.get("core", "executor", fallback="LocalExecutor"), single_host=settings().single_host)
    except ProvisionError as exc:
        raise fail_without_retry(f"provision: {exc}") from exc


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
        raise fail_without_retry(f"reap: {exc}") from exc


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


def prepare_job(config: Mapping[str, Any], cluster: dict[str, Any], shards: dict[str, Any], dag_id: str, run_id: str,
                try_number: int, *, warm_start: Mapping[str, Any], pruning: Mapping[str, Any] | None = None,
                tracking_tags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Write the attempt's job document (``training.train_job.prepare_attempt``: config, where to
    read and write, its status record, the cluster its supervisor attaches to, provisioned again
    for a retry); returns the pointers the training operator keeps. ``warm_start``: the run's
    resolution (``resolve_run_warm_start``'s ``{"reference", "checkpoint"}``: the training DAG's
    reuse check, a sweep's ``plan_trials``), which the job loads whatever the reference resolves
    to by now; nothing is resolved here. A sweep trial's ``run_id`` is its run key
    (``plugins.sweep_tasks.trial_run_id``), with its pruning and the tags of its MLflow run."""
    from infra.cluster import attach
    from training.train_job import AttemptRequest, prepare_attempt

    cfg = load_config(config)
    checkpoint = warm_start["checkpoint"]
    if checkpoint:
        log.info("warm start %s: %s step %s, as the run resolved it", warm_start["reference"], checkpoint["prefix"],
                 checkpoint["step"])
    request = AttemptRequest(config=cfg, paths=run_paths(dag_id, run_id), attempt=try_number,
                             shards_prefix=shards["shards_prefix"], model_code=shards.get("model_code"),
                             warm_start=checkpoint, pruning=dict(pruning or {}),
                             tracking_tags=dict(tracking_tags or {}))
    return prepare_attempt(request, attach(cluster))


def register(config: Mapping[str, Any], params: Mapping[str, Any], shards: dict[str, Any], trained: dict[str, Any],
             validation: dict[str, Any], inputs: Mapping[str, Any], dag_id: str, run_id: str,
             try_number: int, *, airflow_run_url: str = "") -> dict[str, Any]:
    """Evaluate the trained model on the test split, log the run to MLflow and register a version
    with its model card (``training.tracking.job_registration.register_trained_job``), tagged with
    the run's training ``inputs`` (the reuse check's) so a later run on the same inputs reuses it."""
    from training.tracking.evaluation import EvaluationError
    from training.tracking.job_registration import TrainedJob, register_trained_job
    from training.tracking.mlflow_params import ParamConflictError
    from training.tracking.reuse import TrainingInputs
    from training.tracking.server import tracking_uri

    job = TrainedJob(config=load_config(config), dag_id=dag_id, run_id=run_id, try_number=try_number,
                     registered_model_name=params["registered_model_name"], tracking_uri=tracking_uri(),
                     shards_prefix=shards["shards_prefix"], manifest_digest=shards["manifest_digest"],
                     source_fingerprint=shards["fingerprint"],
                     model_prefix=trained["model_prefix"], metrics_uri=trained["metrics_uri"],
                     resumed_from_step=trained["resumed_from_step"], train_attempts=trained["attempt"],
                     restarts=trained.get("restarts", 0),
                     validation_report_uri=validation.get("report_uri"),
                     checkpoints_prefix=trained.get("checkpoint_prefix") or run_paths(dag_id, run_id).checkpoints,
                     airflow_run_url=airflow_run_url, instance_type=params.get("instance_type") or "",
                     model_code_sha256=(shards.get("model_code") or {}).get("sha256", ""),
                     input_tags=TrainingInputs(**inputs).tags())
    try:
        return register_trained_job(job)
    except (ParamConflictError, EvaluationError) as exc:  # conflicting params, unscorable test split: no retry
        raise fail_without_retry(str(exc)) from exc


def shard_in_process(params: Mapping[str, Any], dag_id: str, run_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DAG's sharding tasks in this process, in their order (``shard``, each part's
    ``shard_count``, each part's ``shard_part``, ``shard_merge``): ``(config XCom, shard pointers)``."""
    config, planned = shard(params, dag_id, run_id)
    for part in planned["parts"]:
        shard_count(config, planned, part)
    for part in planned["parts"]:
        shard_part(config, planned, part)
    return config, shard_merge(config, planned, dag_id, run_id)
