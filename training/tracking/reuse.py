"""Reusing an earlier run's registered model version when a training run's inputs match its.

Four inputs decide what a training run produces (``TrainingInputs``): the shard manifest's
digest (the data as split and sharded), the digest of the config fields that decide the model
(``training.loop.resume.model_digest``, computed by the caller: tracking never imports the
loop), the sha256 of a custom network's staged code (``common.model_code``; "none" for a network
of the zoo) and the checkpoint a warm start loads (its prefix and step; "none" for none). The
register step tags the DAG run's MLflow run, and so every version registered from it, with each
input and with their combined digest (``input_tags``).

``find_reusable`` asks the registry for the versions of the model carrying the combined digest
and takes the newest READY one whose tags match every input and whose run FINISHED (``choose``,
the matching itself, without MLflow); when none matches it also finds the newest version with
recorded inputs, so the log can say which input changed since (``changed_inputs``).
``record_reuse`` writes what a reuse leaves in MLflow: a small FINISHED run of the reusing DAG
run (its Airflow tags, the version reused and the run that trained it) and, on the version,
the ``mxpipe.reused_by`` tag naming the latest DAG run that reused it.

The record lives in MLflow only (no cache file: the Airflow workers share no disk). mlflow is
imported inside the functions.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from training.tracking.runs import (PIPELINE_EXPERIMENT, bounded_mlflow_env, dag_run_name, dag_run_tags, open_run,
                                    run_url)

log = logging.getLogger(__name__)

# The combined digest of the four inputs: what the registry is searched by.
INPUTS_TAG = "mxpipe.inputs_digest"
# One tag per input (``mxpipe.input.<field of TrainingInputs>``): what a match checks one by one
# and what the log names when an input changed.
INPUT_TAG_PREFIX = "mxpipe.input."
# An input that does not apply (a zoo network's code, no warm start); MLflow shows "" badly.
NONE = "none"
# On the reusing DAG run's MLflow run: the version it reused (name/version) and the DAG run and
# MLflow run that trained it.
REUSED_VERSION_TAG = "mxpipe.reused_version"
REUSED_FROM_TAG = "mxpipe.reused_from"
REUSED_FROM_RUN_TAG = "mxpipe.reused_from_mlflow_run"
# On the reused version: the latest DAG run (dag_id/run_id) that reused it; every reuse's own
# run carries REUSED_VERSION_TAG, so all of them are one search away.
REUSED_BY_TAG = "mxpipe.reused_by"
# The run metrics a reuse hands on as its own (the register step's headline metrics).
HEADLINE_METRICS = ("test_accuracy", "test_rmse", "test_r2")


@dataclass(frozen=True)
class TrainingInputs:
    """What decides the model a training run produces."""

    manifest_digest: str  # the shard manifest's digest (common.manifest)
    config_digest: str  # training.loop.resume.model_digest of the run's config
    code_sha256: str = NONE  # a custom network's staged code (common.model_code); NONE for the zoo
    warm_start: str = NONE  # "<checkpoint prefix>@<step>" the warm start loads; NONE for none

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:32]

    def tags(self) -> dict[str, str]:
        """The tags the register step puts on the run (and so on its versions)."""
        return {INPUTS_TAG: self.digest(), **{INPUT_TAG_PREFIX + k: v for k, v in asdict(self).items()}}

    @classmethod
    def of(cls, manifest_digest: str, config_digest: str, code_sha256: str | None,
           warm_start: Mapping[str, Any] | None) -> TrainingInputs:
        """From the shard task's pointers, the config digest and the resolved warm start
        (``{"prefix", "step", ...}`` or None)."""
        warm = f"{warm_start['prefix']}@{warm_start['step']}" if warm_start else NONE
        return cls(manifest_digest, config_digest, code_sha256 or NONE, warm)


def changed_inputs(inputs: TrainingInputs, tags: Mapping[str, str]) -> list[str]:
    """The inputs whose value in ``tags`` (a version's) differs from ``inputs``' ("code_sha256", …)."""
    return [k for k, v in asdict(inputs).items() if tags.get(INPUT_TAG_PREFIX + k) != v]


def choose(versions: Iterable[Any], inputs: TrainingInputs, run_of: Callable[[str], Any]) -> tuple[Any, Any] | None:
    """``(version, its run)`` of the newest version whose tags match ``inputs`` on every input,
    that is READY and whose run ``run_of(run_id)`` FINISHED (None: deleted or not found); None
    when there is none. A version whose run failed after registering is never reused."""
    wanted = inputs.tags()
    for version in sorted(versions, key=lambda v: int(v.version), reverse=True):
        if version.status != "READY" or any(version.tags.get(k) != v for k, v in wanted.items()):
            continue
        run = run_of(version.run_id) if version.run_id else None
        if run is not None and run.info.status == "FINISHED" and run.info.lifecycle_stage == "active":
            return version, run
    return None


@dataclass(frozen=True)
class Reusable:
    """A registered version an earlier run trained on the same inputs."""

    name: str
    version: str
    mlflow_run_id: str
    dag_id: str
    dag_run_id: str
    run_url: str
    metrics: dict[str, float]
    review: str  # the version's review tag (promoted, rejected, gate_failed) or ""

    def describe(self) -> str:
        # The review's outcome too: the same inputs train the same model, so a rejected version
        # is reused as it is, and the log says so.
        review = f", review: {self.review}" if self.review else ""
        return (f"version {self.version} of {self.name}, trained by DAG run {self.dag_id}/{self.dag_run_id} "
                f"(MLflow run {self.mlflow_run_id}{review})")


@dataclass(frozen=True)
class Search:
    """What ``find_reusable`` found: the match, or the newest version with recorded inputs and
    the inputs that differ from it (None and [] when no version recorded any)."""

    match: Reusable | None
    newest_version: str | None = None
    changed: tuple[str, ...] = ()

    def explain(self, inputs: TrainingInputs, name: str) -> str:
        """One line for the log: which version matches, or why none does."""
        if self.match is not None:
            return f"inputs {inputs.digest()} match {self.match.describe()}"
        if self.newest_version is None:
            return f"no version of {name} with recorded inputs matches inputs {inputs.digest()}"
        if not self.changed:
            return (f"inputs {inputs.digest()} match version {self.newest_version} of {name}, but its run did not "
                    "finish successfully")
        return (f"inputs {inputs.digest()}: {', '.join(self.changed)} changed since version {self.newest_version} "
                f"of {name}")


def _client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _versions(client: Any, query: str, **kwargs: Any) -> list[Any]:
    from mlflow.exceptions import MlflowException

    try:
        return list(client.search_model_versions(query, **kwargs))
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":  # no such registered model yet
            return []
        raise


def _run_or_none(client: Any, run_id: str) -> Any:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def find_reusable(tracking_uri: str, name: str, inputs: TrainingInputs) -> Search:
    """The version of registered model ``name`` an earlier run trained on ``inputs``, if any."""
    with bounded_mlflow_env():
        client = _client(tracking_uri)
        found = choose(_versions(client, f"name = '{name}' and tags.`{INPUTS_TAG}` = '{inputs.digest()}'"), inputs,
                       lambda run_id: _run_or_none(client, run_id))
        if found is None:
            # Only for the log: the newest version with recorded inputs, and what differs from it.
            newest = _versions(client, f"name = '{name}' and tags.`{INPUTS_TAG}` LIKE '%'",
                               order_by=["version_number DESC"], max_results=1)
            if not newest:
                return Search(None)
            return Search(None, str(newest[0].version), tuple(changed_inputs(inputs, newest[0].tags)))
    version, run = found
    return Search(Reusable(
        name=name, version=str(version.version), mlflow_run_id=run.info.run_id,
        dag_id=run.data.tags.get("airflow.dag_id", ""), dag_run_id=run.data.tags.get("airflow.run_id", ""),
        run_url=run_url(tracking_uri, run.info.experiment_id, run.info.run_id),
        metrics={k: run.data.metrics[k] for k in HEADLINE_METRICS if k in run.data.metrics},
        review=version.tags.get("review", "")))


def record_reuse(tracking_uri: str, reused: Reusable, inputs: TrainingInputs, dag_id: str,
                 run_id: str) -> dict[str, Any]:
    """The reusing DAG run's MLflow run (found again on a retry) and the version's
    ``REUSED_BY_TAG``; returns what the run's register step would have: the version, its model
    URI, the run that trained it, its headline metrics, and ``reused_from``, ``reuse_run_id`` and
    ``reuse_run_url``."""
    import time

    from mlflow.entities import Metric, RunStatus

    tags = {REUSED_VERSION_TAG: f"{reused.name}/{reused.version}",
            REUSED_FROM_TAG: f"{reused.dag_id}/{reused.dag_run_id}", REUSED_FROM_RUN_TAG: reused.mlflow_run_id,
            **inputs.tags()}
    with bounded_mlflow_env():
        client = _client(tracking_uri)
        run = open_run(client, experiment=PIPELINE_EXPERIMENT, run_name=dag_run_name(dag_id, run_id),
                       find_tags=dag_run_tags(dag_id, run_id), tags=tags)
        rid = run.info.run_id
        if reused.metrics:  # the reused version's scores, so this run's row in the UI shows them too
            now = int(time.time() * 1000)
            client.log_batch(rid, metrics=[Metric(k, v, now, 0) for k, v in reused.metrics.items()], synchronous=True)
        client.set_terminated(rid, RunStatus.to_string(RunStatus.FINISHED))
        client.set_model_version_tag(reused.name, reused.version, REUSED_BY_TAG, f"{dag_id}/{run_id}")
        url = run_url(tracking_uri, run.info.experiment_id, rid)
    log.info("reused %s; recorded in MLflow run %s", reused.describe(), url)
    return {"registered_model_name": reused.name, "version": reused.version,
            "model_uri": f"models:/{reused.name}/{reused.version}", "run_id": reused.mlflow_run_id,
            "run_url": reused.run_url, **reused.metrics, "reused": True,
            "reused_from": {"dag_id": reused.dag_id, "run_id": reused.dag_run_id},
            "reuse_run_id": rid, "reuse_run_url": url}

