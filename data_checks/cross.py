"""Checks that need every shard at once, reported beside the per-shard GX results.

* every shard in the manifest was validated;
* train shard sizes are balanced, and so are their label distributions;
* the manifest has the train shards the config asks for;
* declared classes that have no rows (a warning);
* without declared classes, label values that look accidental: a class with a handful of rows,
  or one far rarer than the median class (``data.rare_label_action``: a warning, or a failure);
* no id appears twice across shards (from the id hashes of the per-shard runs);
* label distribution drift and schema change against the dataset's previous validated manifest
  (``data.drift_action``: "warn" reports, "fail" fails, "off" skips).

The label checks (label mix, declared classes, label drift) are for classification: a
regression manifest (float targets, ``common.manifest.is_regression``) has no classes, and its
targets are checked per shard (finite, in ``data.target_range``).

Each check is a dict ``{check, success, severity, description, failures, …details}``; a failed
check of severity "warn" is a warning, not a failure.
"""
from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from common.manifest import is_regression, load_manifest
from data_checks.errors import DataError

if TYPE_CHECKING:
    from common.config import TrainConfig

log = logging.getLogger(__name__)

_EXAMPLES = 5
# A shard's label mix is judged only when it holds this many rows per class (else it is noise).
_MIN_ROWS_PER_CLASS_FOR_SKEW = 10


def cross_shard_checks(manifest: dict[str, Any], results: dict[str, dict[str, Any] | None],
                       ids: dict[str, np.ndarray], cfg: "TrainConfig",
                       previous_manifest_uri: str | None) -> list[dict[str, Any]]:
    classification = not is_regression(manifest)
    checks = [_all_validated(manifest, results), _balanced(manifest, cfg),
              *([_label_skew(manifest, cfg)] if classification else []), _layout(manifest, cfg),
              *([_declared_present(manifest), _rare_labels(manifest, results, cfg)] if classification else [])]
    if manifest.get("id_column"):
        checks.append(_unique_ids(ids, manifest))
    checks += _drift(manifest, cfg, previous_manifest_uri)
    return checks


def _check(name: str, description: str, failures: list[dict[str, Any]], severity: str = "fail",
           **details: Any) -> dict[str, Any]:
    for f in failures:
        f.setdefault("expectation", name)
        f.setdefault("column", None)
        f["severity"] = severity
    return {"check": name, "success": not failures, "severity": severity, "description": description,
            "failures": failures, **details}


def _all_validated(manifest: dict[str, Any], results: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    missing = [s["name"] for s in manifest["shards"] if results.get(s["name"]) is None]
    failures = [{"unexpected_count": len(missing), "examples": missing[:_EXAMPLES],
                 "message": f"{len(missing)} shard(s) have no validation result (their task did not finish): "
                            f"{missing[:_EXAMPLES]}"}] if missing else []
    return _check("all_shards_validated", "every shard of the manifest was validated", failures)


def _balanced(manifest: dict[str, Any], cfg: "TrainConfig") -> dict[str, Any]:
    """No train shard holds more than ``max_shard_imbalance`` × the mean (or more than ceil(mean),
    the least any split can achieve, so tiny datasets are not failed for being indivisible)."""
    counts = {s["name"]: s["count"] for s in manifest["shards"] if s["split"] == "train"}
    mean = sum(counts.values()) / len(counts) if counts else 0.0
    limit = max(cfg.data.max_shard_imbalance * mean, math.ceil(mean))
    over = {n: c for n, c in counts.items() if c > limit}
    failures = [{"column": "shard", "unexpected_count": len(over),
                 "examples": [f"{n}: {c} rows" for n, c in list(over.items())[:_EXAMPLES]],
                 "message": f"{len(over)} train shard(s) hold more than {limit:.1f} rows "
                            f"({cfg.data.max_shard_imbalance} × mean {mean:.1f})"}] if over else []
    return _check("train_shards_balanced", "no train shard holds more than max_shard_imbalance × the mean",
                  failures, counts=counts, mean=mean, limit=limit)


def _distribution(hist: dict[str, int], classes: list[Any]) -> dict[str, float]:
    """A label histogram (by class index) as shares keyed by class value (JSON text)."""
    total = sum(hist.values())
    return {str(classes[int(k)]) if int(k) < len(classes) else f"#{k}": n / total
            for k, n in hist.items()} if total else {}


def tvd(p: dict[str, float], q: dict[str, float]) -> float:
    """Total variation distance: the share of rows that would have to change class."""
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def _label_skew(manifest: dict[str, Any], cfg: "TrainConfig") -> dict[str, Any]:
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    classes = manifest["classes"]
    total: dict[str, int] = {}
    for s in train:
        for k, n in s["label_histogram"].items():
            total[k] = total.get(k, 0) + n
    overall = _distribution(total, classes)
    skews, judged = {}, []
    for s in train:
        if s["label_histogram"] and s["count"] >= _MIN_ROWS_PER_CLASS_FOR_SKEW * max(len(total), 1):
            skews[s["name"]] = round(tvd(_distribution(s["label_histogram"], classes), overall), 4)
            judged.append(s["name"])
    over = {n: d for n, d in skews.items() if d > cfg.data.max_label_skew}
    failures = [{"column": "label", "unexpected_count": len(over),
                 "examples": [f"{n}: distance {d:.2f}" for n, d in list(over.items())[:_EXAMPLES]],
                 "message": f"{len(over)} train shard(s) have a label mix far from the train split's "
                            f"(total variation distance > {cfg.data.max_label_skew}): "
                            f"{', '.join(f'{n} ({d:.2f})' for n, d in list(over.items())[:_EXAMPLES])}"}] if over else []
    return _check("train_shard_label_skew", "each train shard's label mix is close to the train split's",
                  failures, distances=skews, judged=judged, limit=cfg.data.max_label_skew)


def _layout(manifest: dict[str, Any], cfg: "TrainConfig") -> dict[str, Any]:
    n_train = sum(1 for s in manifest["shards"] if s["split"] == "train")
    failures = [] if n_train == cfg.num_train_shards else [{
        "unexpected_count": 1, "examples": [], "observed_value": n_train,
        "message": f"manifest has {n_train} train shards, the config asks for {cfg.num_train_shards}"}]
    return _check("train_shard_count_matches_config", "the manifest has the configured number of train shards",
                  failures, observed=n_train, expected=cfg.num_train_shards)


def _declared_present(manifest: dict[str, Any]) -> dict[str, Any]:
    declared = manifest.get("declared_classes") or []
    seen = {int(k) for s in manifest["shards"] for k in s["label_histogram"]}
    absent = [c for i, c in enumerate(declared) if i not in seen]
    failures = [{"column": "label", "unexpected_count": len(absent), "examples": absent[:_EXAMPLES],
                 "message": f"{len(absent)} declared classes have no rows: {absent[:_EXAMPLES]}"}] if absent else []
    return _check("declared_classes_present", "every declared class has rows", failures, severity="warn")


def _rare_labels(manifest: dict[str, Any], results: dict[str, dict[str, Any] | None],
                 cfg: "TrainConfig") -> dict[str, Any]:
    """Classes with at most ``rare_label_rows`` rows, or fewer than ``rare_label_ratio`` × the
    median class's, when no label set is declared: likely a typo or a stray value, not a class."""
    d = cfg.data
    name, description = "labels_look_intended", "no class is a handful of rows or far rarer than the rest"
    if d.rare_label_action == "off" or manifest.get("declared_classes"):
        why = "data.rare_label_action is 'off'" if d.rare_label_action == "off" else "data.classes is declared"
        return _check(name, description, [], severity="warn", skipped=why)
    counts: dict[int, int] = {}
    for s in manifest["shards"]:
        for k, n in s["label_histogram"].items():
            counts[int(k)] = counts.get(int(k), 0) + n
    median = float(np.median(list(counts.values()))) if counts else 0.0
    rare = sorted((k for k, n in counts.items() if n <= d.rare_label_rows or n < d.rare_label_ratio * median),
                  key=lambda k: counts[k])
    rows: dict[int, int] = {}
    for result in results.values():
        for k, row in ((result or {}).get("label_rows") or {}).items():
            rows.setdefault(int(k), row)
    classes = manifest["classes"]

    def value(k: int) -> Any:  # a class index outside the manifest's classes fails its own check
        return classes[k] if k < len(classes) else f"#{k}"

    examples = [f"{value(k)!r}: {counts[k]} rows (median class {median:g})"
                + (f", e.g. source row {rows[k]}" if k in rows else "") for k in rare[:_EXAMPLES]]
    failures = [{"column": "label", "unexpected_count": len(rare), "examples": examples,
                 "message": f"{len(rare)} label value(s) look accidental (at most {d.rare_label_rows} rows, or fewer "
                            f"than {d.rare_label_ratio:g} × the median class's {median:g}): {'; '.join(examples)}; "
                            "fix the labels, or declare data.classes if they are intended"}] if rare else []
    return _check(name, description, failures, severity="fail" if d.rare_label_action == "fail" else "warn",
                  counts={str(value(k)): counts[k] for k in rare})


def _unique_ids(ids: dict[str, np.ndarray], manifest: dict[str, Any]) -> dict[str, Any]:
    """Duplicates across shards by 64-bit id hash (a false match needs ~4e9 ids to be likely)."""
    arrays = [a for a in ids.values() if len(a)]
    pairs = np.concatenate(arrays) if arrays else np.empty((0, 2), np.uint64)
    order = np.argsort(pairs[:, 0], kind="stable")
    hashes, rows = pairs[order, 0], pairs[order, 1]
    dup = np.flatnonzero(hashes[1:] == hashes[:-1])
    dup_hashes = np.unique(hashes[dup + 1]) if len(dup) else np.empty(0, np.uint64)
    examples = []
    for h in dup_hashes[:_EXAMPLES]:
        examples.append(f"source rows {sorted(int(r) for r in rows[hashes == h])}")
    extra = int(len(dup))
    failures = [{"column": manifest.get("id_column"), "unexpected_count": extra, "examples": examples,
                 "message": f"{len(dup_hashes)} ids of column {manifest.get('id_column')!r} appear more than once "
                            f"({extra} extra rows) across shards, e.g. {examples[:3]}"}] if extra else []
    return _check("ids_unique_across_shards", "no id appears twice in the dataset", failures,
                  ids_checked=int(len(hashes)))


def _drift(manifest: dict[str, Any], cfg: "TrainConfig", previous_uri: str | None) -> list[dict[str, Any]]:
    """Label distribution and schema against the dataset's previous validated manifest."""
    action = cfg.data.drift_action
    if action == "off" or not previous_uri:
        why = "data.drift_action is 'off'" if action == "off" else "no previous validated manifest"
        return [_check("label_drift", "label distribution close to the previous validated run's", [],
                       severity="warn", skipped=why)]
    try:
        previous = load_manifest(previous_uri)
    except (DataError, OSError) as exc:
        log.warning("cannot read the previous manifest %s: drift not checked (%s)", previous_uri, exc)
        return [_check("label_drift", "label distribution close to the previous validated run's", [],
                       severity="warn", skipped=f"previous manifest unreadable: {exc}")]
    severity = "fail" if action == "fail" else "warn"
    schema = _schema_drift(manifest, previous, previous_uri, severity)
    if is_regression(manifest) or is_regression(previous):
        return [_check("label_drift", "label distribution close to the previous validated run's", [],
                       severity="warn", skipped="regression targets have no label distribution"), schema]

    def overall(m: dict[str, Any]) -> dict[str, float]:
        hist: dict[str, int] = {}
        for s in m["shards"]:
            for k, n in s["label_histogram"].items():
                hist[k] = hist.get(k, 0) + n
        return _distribution(hist, m["classes"])

    now, before = overall(manifest), overall(previous)
    distance = round(tvd(now, before), 4)
    changes = sorted(set(now) | set(before), key=lambda k: -abs(now.get(k, 0) - before.get(k, 0)))
    examples = [f"class {k}: {before.get(k, 0):.1%} → {now.get(k, 0):.1%}" for k in changes[:_EXAMPLES]]
    drift_failures = [{"column": "label", "unexpected_count": 1, "examples": examples, "observed_value": distance,
                       "message": f"label distribution moved by {distance:.3f} (total variation distance, limit "
                                  f"{cfg.data.drift_threshold}) since {previous_uri}: {'; '.join(examples[:3])}"}] \
        if distance > cfg.data.drift_threshold else []
    new = sorted(set(now) - set(before))
    gone = sorted(set(before) - set(now))
    rows_now = sum(s["count"] for s in manifest["shards"])
    rows_before = sum(s["count"] for s in previous["shards"])
    drift = _check("label_drift", "label distribution close to the previous validated run's", drift_failures,
                   severity=severity, distance=distance, threshold=cfg.data.drift_threshold,
                   previous_manifest_uri=previous_uri, new_classes=new, missing_classes=gone,
                   rows=rows_now, previous_rows=rows_before, current=now, previous=before)
    return [drift, schema]


def _schema_drift(manifest: dict[str, Any], previous: dict[str, Any], previous_uri: str,
                  severity: str) -> dict[str, Any]:
    cols_now, cols_before = manifest["feature_columns"], previous["feature_columns"]
    schema_failures = [] if cols_now == cols_before else [{
        "column": None, "unexpected_count": 1,
        "examples": [f"added {[c for c in cols_now if c not in cols_before][:_EXAMPLES]}",
                     f"removed {[c for c in cols_before if c not in cols_now][:_EXAMPLES]}"],
        "message": f"feature columns differ from the previous validated manifest {previous_uri} "
                   f"({len(cols_before)} → {len(cols_now)} columns)"}]
    return _check("schema_matches_previous", "feature columns equal the previous validated run's",
                  schema_failures, severity=severity)
