"""The MLflow runs a DAG run writes to: found by its Airflow tags, created once, reused by
every attempt, the live tracking of its training and ``register``; and the bounded MLflow client
settings every call runs under.

Only the MLflow client (``mlflow-skinny`` is enough): the job's supervisor keeps its run live
from wherever the cluster runs it (``training.tracking.live``), the trainer image included, so
nothing here may import the evaluation, plots or pandas.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from training.tracking.mlflow_params import MAX_PARAMS_PER_BATCH, chunked

MLFLOW_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
    # MLflow 3 otherwise looks for uv.lock + pyproject.toml in the *current directory* and copies
    # them into the model: what a model carries would depend on the task's cwd. Requirements
    # are pinned explicitly instead.
    "MLFLOW_UV_AUTO_DETECT": "false",
    "MLFLOW_LOG_UV_FILES": "false",
    # System metrics (CPU, memory, disk, network) are sampled while the run is logged; the 10 s
    # default would leave a register step of a few seconds with no sample at all.
    "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1",
}

# The experiment of the training DAG's runs (live tracking and ``register`` alike).
PIPELINE_EXPERIMENT = "mxnet-pipeline"


def dag_run_tags(dag_id: str, run_id: str) -> dict[str, str]:
    """The tags that find a DAG run's MLflow run: every attempt (and ``register``) looks it up by them."""
    return {"airflow.dag_id": dag_id, "airflow.run_id": run_id}


def dag_run_name(dag_id: str, run_id: str) -> str:
    """The MLflow run name of a DAG run (and the job's ``run_name``)."""
    return f"{dag_id}/{run_id}"


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


@contextlib.contextmanager
def environ_restored(names: Iterable[str]) -> Iterator[None]:
    """Put the variables ``names`` back as they were (set to their value, or unset) when the block
    ends, whatever it changed.

    MLflow takes its own settings from this process's environment only, so a call's MLflow
    options are set there for its duration. The snapshot is of values handed to MLflow, never
    interpreted here: the one read of ``os.environ`` outside ``common.settings``
    (``tests/unit/test_settings.py`` allows exactly this function).
    """
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def bounded_mlflow_env(overrides: Mapping[str, str] | None = None) -> Iterator[None]:
    """Apply ``MLFLOW_ENV_DEFAULTS`` for the duration; explicit env settings win, ``overrides`` win over both."""
    wanted = {**MLFLOW_ENV_DEFAULTS, **(overrides or {})}
    with environ_restored(wanted):
        for key, value in wanted.items():
            if overrides and key in overrides:
                os.environ[key] = str(value)
            else:
                os.environ.setdefault(key, str(value))
        yield


@contextlib.contextmanager
def fluent_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (``log_model``, ``evaluate``) at ``uri`` for the duration.

    ``mlflow.set_tracking_uri`` also writes ``MLFLOW_TRACKING_URI`` (for subprocesses), so a
    plain set-and-restore would leave the variable changed, or set where the process had none:
    the fluent API goes back to the URI it resolved before, and the variable to what it was.
    (Public API only: that URI stays set in code afterwards, so a later change of the variable
    in this process no longer moves the fluent API; the project passes URIs explicitly.)
    """
    import mlflow

    previous = mlflow.get_tracking_uri()
    with environ_restored(["MLFLOW_TRACKING_URI"]):
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(previous)


def get_or_create_experiment(client: Any, name: str) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name)
        except MlflowException as e:  # created concurrently by another task
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            exp = client.get_experiment_by_name(name)
    if exp.lifecycle_stage != "active":
        raise ValueError(f"MLflow experiment {name!r} is deleted; restore it or use another name")
    return exp.experiment_id


def tags_query(tags: Mapping[str, str]) -> str:
    return " and ".join(f"tags.`{key}` = '{value}'" for key, value in tags.items())


def open_run(client: Any, *, experiment: str, run_name: str, find_tags: Mapping[str, str],
             tags: Mapping[str, str]) -> Any:
    """The active run of ``experiment`` carrying every one of ``find_tags`` (its ``tags`` set
    again: they are mutable), or a new one carrying both: how a training attempt finds the run
    its DAG run's earlier attempts (and later ``register``) use."""
    experiment_id = get_or_create_experiment(client, experiment)
    found = client.search_runs([experiment_id], filter_string=tags_query(find_tags), max_results=1)
    if not found:
        return client.create_run(experiment_id, run_name=run_name, tags={**find_tags, **tags})
    log_tags(client, found[0].info.run_id, tags)
    return found[0]


def find_run(tracking_uri: str, experiment: str, tags: Mapping[str, str]) -> str | None:
    """The id of a run of ``experiment`` carrying every one of ``tags``, or None.

    A retried attempt passes this as ``log_model_run(run_id=...)``, so it reuses the run its
    first attempt created (e.g. tagged with the Airflow dag and run ids) instead of a second one.
    """
    from mlflow.tracking import MlflowClient

    with bounded_mlflow_env():
        client = MlflowClient(tracking_uri)
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return None
        found = client.search_runs([exp.experiment_id], filter_string=tags_query(tags), max_results=1)
    return found[0].info.run_id if found else None


def log_tags(client: Any, run_id: str, tags: Mapping[str, str]) -> None:
    from mlflow.entities import RunTag

    for batch in chunked(sorted(tags.items()), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in batch], synchronous=True)
