"""What each task of the model-review DAG does (the DAG file only wires them together).

Trigger: an event on ``model_asset(name)``, which the training DAG's ``register`` task emits
through its AssetAlias (with ``extra={"registered_model_name": ..., "version": ...}``), or a manual run with
the DAG's Params. ``gate`` decides whether a reviewer is asked at all; the decision comes from
Airflow's ``ApprovalOperator``; its XCom
(``chosen_options``, ``params_input``, ``responded_by_user``) is what ``apply_*`` read.

Light at import (the DAG file imports it at parse time): ``airflow.sdk.Asset`` and the gate's
defaults and Param schema (``training.tracking.gate``, stdlib only); mlflow and the rest of the
training code are imported inside the functions.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from airflow.sdk import Asset

from common.settings import settings
from plugins.connections import apply_connections
from plugins.failures import fail_without_retry
from training.tracking.gate import DEFAULT_GATE, PARAM_SCHEMA as GATE_SCHEMA  # noqa: F401  (the DAG's Param)

log = logging.getLogger(__name__)


def model_asset(name: str) -> Asset:
    """The Asset "a new version of registered model ``name`` exists" (producer: ``register``).

    The ``x-`` scheme is Airflow's mark of a user-defined scheme: it skips the URI normalizer
    lookup, which would load every provider's asset handlers (the Amazon one imports boto3)
    while the DAG file is parsed.
    """
    return Asset(uri=f"x-mlflow://models/{name}", name=f"mlflow-model-{name}", group="model")


def review_models() -> list[str]:
    """Registered models whose new versions trigger a review (``MXPIPE_REVIEW_MODELS``, comma-separated)."""
    return [n.strip() for n in settings().review_models.split(",") if n.strip()]


def _tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, which a review requires (no fallback to MLflow's default store)."""
    apply_connections()  # mlflow_default and aws_default, for the rest of this task's process
    uri = settings().mlflow_tracking_uri
    if not uri:
        raise fail_without_retry("no mlflow_default connection and MLFLOW_TRACKING_URI is not set: "
                                 "nowhere to find the models")
    return uri


def _from_events(events: Mapping[Any, Iterable[Any]] | None) -> tuple[str | None, str | None]:
    """The newest triggering event that names a model version: ``(name, version)``."""
    latest: tuple[Any, str | None, str | None] | None = None
    for asset, asset_events in (events or {}).items():
        for event in asset_events:
            extra = getattr(event, "extra", None) or {}
            uri = getattr(asset, "uri", str(asset))
            name = extra.get("registered_model_name") or uri.rsplit("/", 1)[-1]
            stamp = getattr(event, "timestamp", None)
            if latest is None or (stamp is not None and latest[0] is not None and stamp > latest[0]):
                latest = (stamp, name, str(extra["version"]) if extra.get("version") else None)
    return (latest[1], latest[2]) if latest else (None, None)


def resolve(params: Mapping[str, Any], triggering_events: Mapping[Any, Iterable[Any]] | None) -> dict[str, Any]:
    """Which version to review: the triggering event's, else the Params' (empty = the challenger)."""
    from training.tracking.review import ReviewError, resolve_target

    event_name, event_version = _from_events(triggering_events)
    name = event_name or params["model_name"]
    version = event_version or (str(params.get("version") or "") or None)
    try:
        target = resolve_target(_tracking_uri(), name, version, params.get("shards_prefix") or None)
    except ReviewError as exc:  # the same input fails the same way: no retry
        raise fail_without_retry(f"review: {exc}") from exc
    log.info("reviewing %s version %s against champion %s", target.name, target.challenger,
             target.champion or "(none yet)")
    return target.to_dict()


def compare(target: Mapping[str, Any], dag_id: str, run_id: str) -> dict[str, Any]:
    """Evaluate challenger and champion on the same test split; log the review run."""
    from training.tracking.evaluation import EvaluationError
    from training.tracking.review import Target, review
    from training.tracking.runs import dag_run_name, dag_run_tags

    try:
        return review(_tracking_uri(), Target(**target), run_name=dag_run_name(dag_id, run_id),
                      tags=dag_run_tags(dag_id, run_id))
    except EvaluationError as exc:  # no test rows, or a version that cannot score them: no retry
        raise fail_without_retry(f"review: {exc}") from exc


def gate(target: Mapping[str, Any], reviewed: Mapping[str, Any], spec: Mapping[str, Any]) -> dict[str, Any]:
    """The automatic gate on ``compare``'s evaluations (``spec``: the ``gate`` Param); recorded on
    the version and the review run. ``passed`` decides whether a reviewer is asked at all."""
    from training.tracking.gate import GateConfigError
    from training.tracking.review import Target
    from training.tracking.review import gate as run_gate

    try:
        return run_gate(_tracking_uri(), Target(**target), reviewed, spec)
    except GateConfigError as exc:  # a configuration error fails the same way on a retry
        raise fail_without_retry(f"review gate: {exc}") from exc


def _decision(approval: Mapping[str, Any] | None) -> tuple[str, str, str]:
    """``(option, reviewer, comment)`` from the ApprovalOperator's XCom."""
    if not approval:
        raise RuntimeError("no decision recorded by the approval task")
    user = approval.get("responded_by_user") or {}
    if isinstance(user, Mapping):
        reviewer = str(user.get("name") or user.get("id") or "unknown")
    else:
        reviewer = str(user)
    comment = str((approval.get("params_input") or {}).get("comment") or "")
    return approval["chosen_options"][0], reviewer, comment


def apply_approval(target: Mapping[str, Any], reviewed: Mapping[str, Any],
                   approval: Mapping[str, Any] | None) -> dict[str, Any]:
    """Runs only on "Approve" (the operator skips it on "Reject"): ``champion`` moves."""
    from training.tracking.review import promote

    _, reviewer, comment = _decision(approval)
    return promote(_tracking_uri(), target["name"], target["challenger"], reviewer=reviewer, comment=comment,
                   review_run_id=reviewed.get("review_run_id"))


def apply_rejection(target: Mapping[str, Any], reviewed: Mapping[str, Any],
                    approval: Mapping[str, Any] | None) -> dict[str, Any]:
    """Runs only on "Reject": the version is tagged, the aliases stay."""
    from training.tracking.review import reject

    _, reviewer, comment = _decision(approval)
    return reject(_tracking_uri(), target["name"], target["challenger"], reviewer=reviewer, comment=comment,
                  review_run_id=reviewed.get("review_run_id"))
