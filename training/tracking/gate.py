"""The automatic gate before a human review: the challenger's metrics against thresholds and
against the champion's, on the two versions' ``mlflow.models.evaluate`` results.

Configuration (the review DAG's ``gate`` Param): ``{metric: {"greater_is_better": bool, check:
number, ...}}``, metric names as the evaluator reports them (``accuracy_score``, ``f1_score``,
``precision_score``, ``recall_score``, ...). The checks:

- ``threshold``: a floor (a ceiling when lower is better). Applies with or without a champion.
- ``min_absolute_change`` / ``min_relative_change``: MLflow's: the challenger must *beat* the
  champion by at least this much (``> 0``; relative: a fraction of the champion's magnitude).
- ``max_absolute_drop`` / ``max_relative_drop``: a tolerance: the challenger may be *worse* than
  the champion by at most this much (``>= 0``). MLflow's ``MetricThreshold`` only expresses
  required gains (its changes must be positive), so a tolerance is checked as a value threshold
  at the champion's figure minus the drop.

Every check is one ``mlflow.validate_evaluation_results`` call (MLflow 3's replacement for
``evaluate(baseline_model=..., validation_thresholds=...)``) with one ``MetricThreshold``, so each
gets its own row (metric, challenger, champion, threshold, pass/fail) in the table the reviewer
reads. With no champion, the checks against it are skipped and only ``threshold`` applies.

Importing this module is cheap (stdlib only); mlflow is imported inside the functions.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.errors import DeterministicError

# Accuracy may not fall more than a point below the champion's, nor below a floor that only a
# broken model misses (chance is 0.1 on ten classes, 0.5 on two): raise it per model.
DEFAULT_GATE: dict[str, dict[str, Any]] = {
    "accuracy_score": {"greater_is_better": True, "threshold": 0.5, "max_absolute_drop": 0.01},
}
# Regression (MLflow's regressor evaluator): lower test RMSE wins; the challenger's may be at most
# 1 % above the champion's. No floor: an RMSE has the targets' scale.
DEFAULT_REGRESSION_GATE: dict[str, dict[str, Any]] = {
    "root_mean_squared_error": {"greater_is_better": False, "max_relative_drop": 0.01},
}


def gate_for_task(spec: Mapping[str, Any], task: str) -> Mapping[str, Any]:
    """The gate to apply: ``spec`` as given, except that the ``gate`` Param left at its default
    (``DEFAULT_GATE``, accuracy) means the task's default for a regression model."""
    return DEFAULT_REGRESSION_GATE if task == "regression" and dict(spec) == DEFAULT_GATE else spec


CHECKS = ("threshold", "min_absolute_change", "min_relative_change", "max_absolute_drop", "max_relative_drop")
# Checks against the champion (skipped without one).
RELATIVE_TO_CHAMPION = frozenset(CHECKS) - {"threshold"}
# The JSON schema of the DAG's ``gate`` Param: a bad configuration is refused at trigger time.
PARAM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "minProperties": 1,
    "additionalProperties": {
        "type": "object",
        "properties": {
            "greater_is_better": {"type": "boolean"},
            "threshold": {"type": "number"},
            "min_absolute_change": {"type": "number", "exclusiveMinimum": 0},
            "min_relative_change": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "max_absolute_drop": {"type": "number", "minimum": 0},
            "max_relative_drop": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["greater_is_better"],
        "minProperties": 2,
        "additionalProperties": False,
    },
}
# Bounds computed from the champion's figure are rounded: in floats 152/300 - 0.01 is above
# 149/300, and a challenger exactly the tolerated 0.01 below the champion would fail.
BOUND_DECIMALS = 12


class GateConfigError(DeterministicError, ValueError):
    """The gate's configuration is unusable (unknown check, bad number, metric not evaluated)."""


@dataclass(frozen=True)
class Check:
    metric: str
    kind: str  # one of CHECKS
    value: float
    greater_is_better: bool


def parse(spec: Mapping[str, Any]) -> list[Check]:
    """The checks of a gate configuration, in its order; ``GateConfigError`` names what is wrong."""
    if not isinstance(spec, Mapping) or not spec:
        raise GateConfigError(f"the gate must map metric names to their checks, got {spec!r}")
    checks = []
    for metric, entry in spec.items():
        if not isinstance(entry, Mapping):
            raise GateConfigError(f"gate metric {metric!r}: expected an object of checks, got {entry!r}")
        unknown = sorted(set(entry) - {"greater_is_better", *CHECKS})
        if unknown:
            raise GateConfigError(f"gate metric {metric!r}: unknown keys {unknown} (allowed: greater_is_better, "
                                  f"{', '.join(CHECKS)})")
        greater = entry.get("greater_is_better")
        if not isinstance(greater, bool):
            raise GateConfigError(f"gate metric {metric!r}: greater_is_better must be true or false")
        kinds = [k for k in CHECKS if entry.get(k) is not None]
        if not kinds:
            raise GateConfigError(f"gate metric {metric!r}: no check given (one of {', '.join(CHECKS)})")
        for kind in kinds:
            checks.append(Check(metric, kind, _number(metric, kind, entry[kind]), greater))
    return checks


def _number(metric: str, kind: str, raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise GateConfigError(f"gate metric {metric!r}: {kind} must be a finite number, got {raw!r}")
    value = float(raw)
    if kind.startswith("min_") and value <= 0:
        raise GateConfigError(f"gate metric {metric!r}: {kind} must be > 0 (a required gain), got {value}")
    if kind.startswith("max_") and value < 0:
        raise GateConfigError(f"gate metric {metric!r}: {kind} must be >= 0 (a tolerated loss), got {value}")
    if "relative" in kind and value > 1:
        raise GateConfigError(f"gate metric {metric!r}: {kind} is a fraction in [0, 1], got {value}")
    return value


def _bound(check: Check, champion: float) -> float:
    """The value a tolerance check compares with: the champion's figure minus the allowed loss."""
    loss = check.value if check.kind == "max_absolute_drop" else check.value * abs(champion)
    return round(champion - loss if check.greater_is_better else champion + loss, BOUND_DECIMALS)


def _describe(check: Check, champion: float | None) -> str:
    """The check as the table shows it, e.g. ``>= champion - 0.01 (0.9700)``."""
    cmp, gain, loss = (">=", "+", "-") if check.greater_is_better else ("<=", "-", "+")
    v = f"{check.value:g}"
    if check.kind == "threshold":
        return f"{cmp} {v}"
    text = {"min_absolute_change": f"{cmp} champion {gain} {v}",
            "min_relative_change": f"{cmp} champion {gain} {v} x abs(champion)",
            "max_absolute_drop": f"{cmp} champion {loss} {v}",
            "max_relative_drop": f"{cmp} champion {loss} {v} x abs(champion)"}[check.kind]
    if champion is not None and check.kind.startswith("max_"):
        text += f" ({_bound(check, champion):.4f})"
    return text


def _passes(check: Check, challenger: Any, champion: Any) -> bool:
    """One MLflow validation of ``check`` (``champion``: an ``EvaluationResult``, not None)."""
    import mlflow
    from mlflow.models import MetricThreshold
    from mlflow.models.evaluation.validation import ModelValidationFailedException

    baseline = None
    if check.kind == "threshold":
        threshold = MetricThreshold(threshold=check.value, greater_is_better=check.greater_is_better)
    elif check.kind.startswith("max_"):
        threshold = MetricThreshold(threshold=_bound(check, float(champion.metrics[check.metric])),
                                    greater_is_better=check.greater_is_better)
    else:
        threshold = MetricThreshold(**{check.kind: check.value}, greater_is_better=check.greater_is_better)
        baseline = champion
    try:
        mlflow.validate_evaluation_results({check.metric: threshold}, challenger, baseline)
    except ModelValidationFailedException:
        return False
    return True


def evaluate_gate(spec: Mapping[str, Any], challenger: Any, champion: Any | None) -> dict[str, Any]:
    """Run every check of ``spec`` on two ``mlflow.models.EvaluationResult``s (``champion`` None:
    there is none yet). Returns ``{"passed", "reason", "rows", "markdown"}``; ``reason`` names the
    failed checks (empty when passed), ``rows`` are the table's."""
    checks = parse(spec)
    missing = sorted({c.metric for c in checks} - set(challenger.metrics))
    if missing:
        raise GateConfigError(f"gate metrics {missing} are not among the evaluation's metrics "
                              f"{sorted(challenger.metrics)}")
    rows = []
    for check in checks:
        mine = float(challenger.metrics[check.metric])
        theirs = champion.metrics.get(check.metric) if champion is not None else None
        theirs = None if theirs is None else float(theirs)
        row = {"metric": check.metric, "check": check.kind, "challenger": mine, "champion": theirs,
               "threshold": _describe(check, theirs)}
        if check.kind in RELATIVE_TO_CHAMPION and champion is None:
            row["result"] = "skipped (no champion)"
        elif check.kind in RELATIVE_TO_CHAMPION and theirs is None:
            row["result"] = "fail"  # the champion's evaluation lacks the metric: nothing to compare with
        else:
            row["result"] = "pass" if _passes(check, challenger, champion) else "fail"
        rows.append(row)
    failed = [r for r in rows if r["result"] == "fail"]
    reason = "; ".join(f"{r['metric']} {r['challenger']:.4f} is not {r['threshold']}" for r in failed)
    result = {"passed": not failed, "reason": reason, "rows": rows}
    return {**result, "markdown": markdown(result)}


def markdown(result: Mapping[str, Any]) -> str:
    """The gate's table, as the approval form and the review run show it."""
    def fmt(v: float | None) -> str:
        return "–" if v is None else f"{v:.4f}"

    head = "**Gate: passed.**" if result["passed"] else f"**Gate: failed**: {result['reason']}."
    lines = [head, "", "| metric | challenger | champion | threshold | result |", "|---|---|---|---|---|"]
    lines += [f"| {r['metric']} | {fmt(r['challenger'])} | {fmt(r['champion'])} | {r['threshold']} | {r['result']} |"
              for r in result["rows"]]
    return "\n".join(lines)
