"""A DAG run's training job, attempt by attempt: the job document its supervisor reads, and
what a succeeded job hands on to registration.

``stage_run`` writes the run's config and stages a custom network's code before the data is
read; ``check_model_fits`` builds that network for the sharded data. ``prepare_attempt`` writes
one attempt's ``JobSpec`` (``training.launch.job``): the resolved config, where to read the
shards and write checkpoints, the model and metrics, the warm start's checkpoint (resolved
once per DAG run by the caller with ``resolve_warm_start``: ``training.tracking.warm_start``),
a custom network's staged code, the status record, the cluster the supervisor attaches to
(provisioned again for a retry: ``for_attempt``) and the live MLflow run's settings
(``live_tracking``); it reports the step the attempt resumes from (``training.checkpoint``).
``job_result`` reads a succeeded job's metrics into the small dict of pointers the register
step takes.

A top-level module of ``training`` because it joins its parts (launch, checkpoint, tracking);
Airflow-free: the training DAG's train task calls it through ``plugins.pipeline_tasks``. The
cluster is passed in (``AttemptCluster``: what ``infra.cluster.Cluster`` offers), as training
never imports ``infra``.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.config import TrainConfig
from common.model_code import StagedCode
from common.paths import RunPaths
from common.settings import settings

log = logging.getLogger(__name__)


class AttemptCluster(Protocol):
    """The cluster an attempt runs on (``infra.cluster.Cluster``)."""

    def for_attempt(self, attempt: int) -> AttemptCluster: ...

    def job_cluster(self) -> dict[str, Any]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class AttemptRequest:
    """One attempt of a DAG run's training job."""

    config: TrainConfig
    paths: RunPaths  # the DAG run's storage (its dag and run ids name the MLflow run too)
    attempt: int  # 1, 2, ... (the train task's try number)
    shards_prefix: str
    model_code: Mapping[str, str] | None = None  # a staged custom network: {"uri", "sha256"}
    # The checkpoint the warm start loads, as ``resolve_warm_start`` returned it ({"run_id",
    # "prefix", "step", ...}); None: none. Resolved by the caller, once per DAG run, not here: a
    # ``models:/…@alias`` may move between two resolutions, and every attempt must load the
    # checkpoint the run's reuse decision was made on.
    warm_start: Mapping[str, Any] | None = None
    # A sweep trial: its pruning (JobSpec.pruning) and the tags of its live MLflow run (the
    # sweep's parent run: mlflow.parentRunId); empty for a training run.
    pruning: Mapping[str, Any] = field(default_factory=dict)
    tracking_tags: Mapping[str, str] = field(default_factory=dict)


def stage_run(config: TrainConfig, paths: RunPaths) -> StagedCode | None:
    """What the run's job reads besides the data, staged before any data is read: the config
    (``config/train_config.json``) and a custom network's ``model.code_uri``, packed under the
    run's ``code/`` with its sha256 (None without one), its factory imported from the staged copy.
    A bad import path, code location or module raises ``ConfigError``."""
    from common import model_code, storage
    from common.config import is_custom_model
    from training.loop.model import check_factory

    storage.put_bytes(storage.join(paths.config, "train_config.json"), config.to_json().encode())
    if not is_custom_model(config.model.name):
        return None
    code = model_code.stage(config.model.code_uri, paths.code) if config.model.code_uri else None
    check_factory(config, code)
    if code:
        log.info("staged the code of %s from %s: %s (sha256 %s)", config.model.name, config.model.code_uri, code.uri,
                 code.sha256)
    return code


def check_model_fits(config: TrainConfig, code: StagedCode | None, manifest: Mapping[str, Any]) -> None:
    """A custom network built as a worker will build it, for the sharded data's features and
    outputs (its output size checked by shape inference); the zoo's networks need no check.
    Raises ``ConfigError``."""
    from common.config import is_custom_model
    from common.manifest import num_outputs
    from training.loop.model import check_custom_model

    if is_custom_model(config.model.name):
        check_custom_model(config, code, num_outputs(dict(manifest)), manifest["num_features"])


def resolve_warm_start(reference: str, paths: RunPaths, config: TrainConfig) -> dict[str, Any] | None:
    """The checkpoint ``reference`` names as ``{"run_id", "prefix", "step"}`` (plus the version for
    a ``models:/`` reference), or None when it is empty. A reference naming nothing usable raises
    ``WarmStartError``, a wrong checkpoint key ``CheckpointKeyError`` (both configuration)."""
    from training.tracking.server import tracking_uri
    from training.tracking.warm_start import resolve_checkpoint

    reference = reference.strip()
    if not reference:
        return None
    return resolve_checkpoint(reference, dag_id=paths.dag_id, run_id=paths.run_id, artifact_root=paths.root,
                              checkpoint=config.checkpoint, tracking_uri=tracking_uri).as_dict()


def live_tracking(paths: RunPaths, attempt: int, tags: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What the job's supervisor needs to keep the DAG run's MLflow run live while it trains
    (``training.tracking.live``), or {} when ``MXPIPE_LIVE_TRACKING`` is off."""
    from common.version import git_sha
    from training.tracking.runs import PIPELINE_EXPERIMENT, dag_run_name, dag_run_tags
    from training.tracking.server import tracking_uri

    if not settings().live_tracking:
        return {}
    return {"tracking_uri": tracking_uri(), "experiment": PIPELINE_EXPERIMENT,
            "run_name": dag_run_name(paths.dag_id, paths.run_id), "find_tags": dag_run_tags(paths.dag_id, paths.run_id),
            "tags": {"airflow.try_number": str(attempt), "mlflow.source.git.commit": git_sha(), **(tags or {})},
            "sync_s": settings().live_sync_s}


def prepare_attempt(request: AttemptRequest, cluster: AttemptCluster) -> dict[str, Any]:
    """Write the attempt's job document; returns the pointers the train task keeps (job, status
    and metrics URIs, model and checkpoint prefixes, the step it resumes from, the attempt, the
    cluster's description, the live tracking settings)."""
    from common import storage
    from training.checkpoint.store import CheckpointStore
    from training.launch.job import JobSpec
    from training.tracking.runs import dag_run_name

    cfg, paths = request.config, request.paths
    # The job loads it only while this run has no checkpoint of its own (training.loop.worker).
    warm = request.warm_start
    # The cluster places the roles and picks the scheduler's address for this attempt.
    backend = cluster.for_attempt(request.attempt)
    code = request.model_code or {}
    job = JobSpec(config=cfg, shards_prefix=request.shards_prefix, checkpoint_prefix=paths.checkpoints,
                  model_prefix=paths.model, metrics_uri=storage.join(paths.metrics, "train.json"),
                  run_name=dag_run_name(paths.dag_id, paths.run_id),
                  warm_start_prefix=warm["prefix"] if warm else "",
                  model_code_uri=code.get("uri", ""), model_code_sha256=code.get("sha256", ""),
                  status_uri=paths.job_status, cluster=backend.job_cluster(),
                  tracking=live_tracking(paths, request.attempt, request.tracking_tags),
                  pruning=dict(request.pruning))
    job_uri = storage.join(paths.config, "job.json")
    job.save(job_uri)
    committed = CheckpointStore(paths.checkpoints, keep=cfg.checkpoint.keep).committed_steps()
    resume_step = committed[0] if committed else 0
    log.info("attempt %d: %s", request.attempt,
             f"resuming from checkpoint step {resume_step}" if committed else "starting from scratch")
    return {"job_uri": job_uri, "status_uri": job.status_uri, "metrics_uri": job.metrics_uri,
            "model_prefix": paths.model, "checkpoint_prefix": paths.checkpoints, "resumed_from_step": resume_step,
            "attempt": request.attempt, "cluster": backend.describe(), "tracking": job.tracking}


def job_result(job: Mapping[str, Any]) -> dict[str, Any]:
    """What a succeeded job hands on (``prepare_attempt``'s pointers, its metrics file and its
    final status record): the small dict of pointers the register step takes. The step it
    resumed from is its last round's (after a restart in place, that round's checkpoint)."""
    from common import storage
    from training.launch.status import read_status

    metrics = json.loads(storage.get_bytes(job["metrics_uri"]))
    status = read_status(job["status_uri"])
    resumed = metrics.get("resumed_from")
    return {"model_prefix": job["model_prefix"], "metrics_uri": job["metrics_uri"],
            "checkpoint_prefix": job["checkpoint_prefix"],
            "resumed_from_step": job["resumed_from_step"] if resumed is None else resumed,
            "attempt": job["attempt"], "restarts": status.restarts if status is not None else 0,
            "global_step": metrics["global_step"],
            "final_val_accuracy": metrics["history"][-1].get("val_accuracy"),
            # The epoch the exported model is from, when tracked (checkpoint.export_epoch, early stopping).
            "best": metrics.get("best"),
            # A sweep trial's end: the epochs it ran, and after which one its pruner stopped it.
            "epochs_run": len(metrics["history"]), "pruned": metrics.get("pruned")}
