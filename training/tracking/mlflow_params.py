"""What MLflow is sent for a run, before any call: params flattened to strings within MLflow's
limits, metric points keyed by step, and the batching of both.

Pure helpers (stdlib only, unit-tested): MLflow params are immutable, so a retry must produce the
very same strings (truncation is deterministic) and ``params_to_log`` refuses a different value
for a logged key with ``ParamConflictError`` (deterministic: not worth an Airflow retry) instead
of the server's generic 400.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from common.errors import DeterministicError

# MLflow's batch limits (mlflow.utils.validation): 100 params/tags and 1000 metrics per
# log_batch, 1000 entities in all. We never mix params and metrics in one call.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
# MLflow 3.x servers accept 6000-character param values; 500 was the limit for years and is
# what every server version accepts. The full resolved config is logged as an artifact anyway.
MAX_PARAM_VALUE_LENGTH = 500
MAX_KEY_LENGTH = 250


class ParamConflictError(DeterministicError, ValueError):
    """A reused run already holds a different value for a param (MLflow params are immutable)."""


T = TypeVar("T")


def stringify(value: Any) -> str:
    """The string MLflow stores for a param value; lists/tuples as JSON for readability."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value), default=str)
    return str(value)


def truncate_value(value: str, limit: int = MAX_PARAM_VALUE_LENGTH) -> str:
    """Cut an over-long value deterministically (a retry yields the same string) and mark it."""
    if len(value) <= limit:
        return value
    suffix = f"...[truncated, sha256:{hashlib.sha256(value.encode()).hexdigest()[:12]}]"
    return value[: limit - len(suffix)] + suffix


def _valid_key(key: str) -> bool:
    import posixpath
    import re

    if not key or len(key) > MAX_KEY_LENGTH or not re.fullmatch(r"[/\w.\- :]+", key):
        return False
    norm = posixpath.normpath(key)
    return norm == key and not norm.startswith(("..", "/"))


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts (and dataclasses) → dotted keys with string values within MLflow's limits."""
    flat: dict[str, str] = {}
    for raw_key, value in params.items():
        key = f"{prefix}.{raw_key}" if prefix else str(raw_key)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        nested = flatten_params(value, key) if isinstance(value, Mapping) else {key: truncate_value(stringify(value))}
        clash = flat.keys() & nested.keys()
        if clash:
            raise ValueError(f"params flatten to duplicate keys: {sorted(clash)}")
        flat.update(nested)
    if not prefix:
        bad = [k for k in flat if not _valid_key(k)]
        if bad:
            raise ValueError(
                f"invalid MLflow param keys {bad[:10]}: at most {MAX_KEY_LENGTH} characters of "
                "letters, digits, '_', '-', '.', ' ', ':', '/' and no '..' or leading '/'"
            )
    return flat


def chunked(items: Sequence[T], size: int) -> list[list[T]]:
    if size <= 0:
        raise ValueError("size must be positive")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def params_to_log(existing: Mapping[str, str], new: Mapping[str, str]) -> dict[str, str]:
    """The params still to log; raise ``ParamConflictError`` if any value differs from the run's."""
    conflicts = {k: (existing[k], v) for k, v in new.items() if k in existing and existing[k] != v}
    if conflicts:
        lines = "; ".join(f"{k}: logged {old!r}, now {new_v!r}" for k, (old, new_v) in sorted(conflicts.items())[:10])
        raise ParamConflictError(
            f"{len(conflicts)} param(s) differ from the values already logged to this run, and MLflow "
            f"params are immutable ({lines}). A retry must log the same config; a changed config "
            "needs a new run (pass run_id=None)."
        )
    return {k: v for k, v in new.items() if k not in existing}


def metric_points(
    epoch_metrics: Sequence[Mapping[str, float]],
    final_metrics: Mapping[str, float],
) -> tuple[list[tuple[str, float, int]], int]:
    """``(key, value, step)`` triples and the final step.

    An epoch dict may carry its own ``"epoch"`` (used as the step, not logged as a metric);
    otherwise its position in the list is the step. Final metrics are logged at the last epoch's
    step, the step the model is logged at, so MLflow links them to the LoggedModel. A metric
    given twice for one step (e.g. ``global_step`` in the last epoch and in the finals) is
    logged once, with the later value.
    """
    # Keyed by (key, step): a later value for the same point replaces an earlier one.
    by_point: dict[tuple[str, int], float] = {}
    steps = []
    for position, row in enumerate(epoch_metrics):
        step = int(row["epoch"]) if "epoch" in row else position
        steps.append(step)
        by_point.update({(k, step): float(v) for k, v in row.items() if k != "epoch"})
    final_step = max(steps) if steps else 0
    by_point.update({(k, final_step): float(v) for k, v in final_metrics.items()})
    points = [(k, v, step) for (k, step), v in by_point.items()]
    bad = sorted({k for k, _, _ in points if not _valid_key(k)})
    if bad:
        raise ValueError(f"invalid MLflow metric names: {bad[:10]}")
    return points, final_step


def step_metric_points(step_metrics: Sequence[Mapping[str, float]]) -> list[tuple[str, float, int]]:
    """``(key + "_step", value, global_step)`` triples of the worker's per-step records.

    Suffixed so that they do not share a key (and so a step axis) with the per-epoch metrics,
    which MLflow logs at the epoch index. A step given twice is logged once, with the later value.
    """
    by_point = {(f"{k}_step", int(row["step"])): float(v) for row in step_metrics
                for k, v in row.items() if k != "step"}
    bad = sorted({k for k, _ in by_point if not _valid_key(k)})
    if bad:
        raise ValueError(f"invalid MLflow metric names: {bad[:10]}")
    return [(k, v, step) for (k, step), v in by_point.items()]
