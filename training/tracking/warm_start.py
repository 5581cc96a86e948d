"""Which run a warm start names: an Airflow run id, or a registered MLflow model version.

A warm start from ``models:/<name>/<version>`` or ``models:/<name>@<alias>`` resolves the
version through the registry to the training run that produced it. The pipeline's ``register``
step tags every version with that run's ``airflow.dag_id`` and ``airflow.run_id``, and a run's
checkpoints live at a path built from exactly those two (``common.paths.RunPaths``), so the
version's parameters are that run's final checkpoint: the caller checks that the newest valid
checkpoint is at the step the version was logged from. Loading from the checkpoint rather than
from the exported model files keeps one loader for parameters (the worker's), and the
checkpoint is verified by sha256 before anything is provisioned.

``resolve_checkpoint`` turns either form into the checkpoint a job loads. Only an explicitly
named run is used: a new run never picks up another run's checkpoints by itself.

Stdlib-only at import time (the DAG's trigger form uses ``MODEL_URI_PATTERN``). No Airflow here: the caller turns ``WarmStartError`` into a failure that burns no retry (the
same reference fails the same way); an unreachable MLflow server raises other errors, which
stay retryable.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.errors import DeterministicError

if TYPE_CHECKING:
    from common.config import CheckpointConfig

log = logging.getLogger(__name__)

# Plain groups, no named ones: the trigger form's JSON-schema pattern (plugins/params.py) is
# this same text, and JSON schema speaks ECMA regex. Names as registered_model_name allows.
MODEL_URI_PATTERN = r"^models:/([A-Za-z0-9_.-]{1,100})(?:/([0-9]{1,10})|@([A-Za-z0-9_-]{1,255}))$"
# What the registry answers for a missing model or version (RESOURCE_DOES_NOT_EXIST) and for a
# missing alias (INVALID_PARAMETER_VALUE, "Registered model alias X not found.").
_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
DAG_TAG, RUN_TAG = "airflow.dag_id", "airflow.run_id"


class WarmStartError(DeterministicError, ValueError):
    """The warm start names nothing usable: a deterministic failure, a retry would not help."""


@dataclass(frozen=True)
class ModelSource:
    """A registered version and the Airflow run that trained it."""

    name: str
    version: str
    dag_id: str
    run_id: str
    mlflow_run_id: str
    step: int | None  # the global step the model was logged at (the run's final checkpoint)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.name, "version": self.version, "mlflow_run_id": self.mlflow_run_id,
                "model_step": self.step}


def is_model_uri(ref: str) -> bool:
    return ref.startswith("models:/")


def resolve_model(ref: str, tracking_uri: str) -> ModelSource:
    """``models:/name/3`` or ``models:/name@champion`` → the version and its training run."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from training.tracking.runs import bounded_mlflow_env

    match = re.match(MODEL_URI_PATTERN, ref)
    if match is None:
        raise WarmStartError(f"warm_start {ref!r}: expected models:/<name>/<version> or models:/<name>@<alias>")
    name, version, alias = match.groups()
    with bounded_mlflow_env():
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        try:
            mv = client.get_model_version(name, version) if version else client.get_model_version_by_alias(name, alias)
        except MlflowException as exc:
            if exc.error_code in _NOT_FOUND:
                what = f"version {version}" if version else f"alias {alias!r}"
                raise WarmStartError(f"warm_start {ref!r}: no {what} of registered model {name!r} "
                                     f"at {tracking_uri} ({exc.message})") from exc
            raise
        step = _logged_step(client, mv)
    dag_id, run_id = mv.tags.get(DAG_TAG), mv.tags.get(RUN_TAG)
    if not dag_id or not run_id:
        raise WarmStartError(f"warm_start {ref!r}: version {mv.version} of {name!r} was not registered by this "
                             f"pipeline (no {DAG_TAG}/{RUN_TAG} tags), so it has no checkpoint to start from")
    source = ModelSource(name, str(mv.version), dag_id, run_id, mv.run_id or "", step)
    log.info("warm start %s: version %s of %s, trained by %s/%s (MLflow run %s)", ref, source.version, name,
             dag_id, run_id, source.mlflow_run_id)
    return source


def _logged_step(client: Any, mv: Any) -> int | None:
    """The global step of the version's training run (its ``global_step`` metric), if logged."""
    if not mv.run_id:
        return None
    metric = client.get_run(mv.run_id).data.metrics.get("global_step")
    return int(metric) if metric is not None else None


@dataclass(frozen=True)
class WarmStart:
    """The checkpoint a warm start loads: the newest valid one of the source run."""

    run_id: str
    prefix: str
    step: int
    model: ModelSource | None = None  # set when the reference named a registered version

    def as_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "prefix": self.prefix, "step": self.step,
                **(self.model.as_dict() if self.model else {})}


def resolve_checkpoint(source: str, *, dag_id: str, run_id: str, artifact_root: str, checkpoint: CheckpointConfig,
                       tracking_uri: Callable[[], str]) -> WarmStart:
    """The checkpoint run ``run_id`` of ``dag_id`` warm-starts from; ``source`` is a run id of the
    same DAG or a registered version (``tracking_uri`` is asked for only then).

    A missing run, model, version or alias, a run with no checkpoint that verifies, or a version
    whose run's newest checkpoint is not the one it was logged from raise ``WarmStartError``.
    """
    from common.paths import RunPaths
    from training.checkpoint.store import CorruptCheckpoint, store_for

    model = resolve_model(source, tracking_uri()) if is_model_uri(source) else None
    source_dag, source_run = (model.dag_id, model.run_id) if model else (dag_id, source)
    if (source_dag, source_run) == (dag_id, run_id):
        raise WarmStartError(f"warm_start {source!r} is this run itself; a retry resumes its own checkpoints anyway")
    prefix = RunPaths(root=artifact_root, dag_id=source_dag, run_id=source_run).checkpoints
    try:
        ckpt = store_for(prefix, checkpoint).latest()
    except CorruptCheckpoint as exc:
        raise WarmStartError(f"warm_start {source!r}: no valid checkpoint under {prefix}: {exc}") from exc
    if ckpt is None:
        raise WarmStartError(f"warm_start {source!r}: no run of {source_dag} with a committed checkpoint under "
                             f"{prefix} (is the run id right?)")
    if model and model.step is not None and ckpt.step != model.step:
        # The worker loads the newest checkpoint under the prefix: it must be the version's.
        raise WarmStartError(f"warm_start {source!r}: the newest valid checkpoint of run {source_run} is step "
                             f"{ckpt.step}, but version {model.version} was logged at step {model.step}")
    log.info("warm start from %s step %d (%s)", source, ckpt.step, prefix)
    return WarmStart(source_run, prefix, ckpt.step, model)
