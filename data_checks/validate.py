"""Validate committed shards with Great Expectations (1.x, code-first, ephemeral context).

All shards are loaded into one pandas frame (one batch) and checked by one suite run:

* the table's columns match the manifest's schema, it has rows, every shard contributes rows;
* no feature is NaN or ±inf (see ``_nonfinite_column``: one derived column, one expectation);
* labels are class indices ``0..num_classes-1``; row ids are unique and inside the source's range.

Two checks that GE cannot express on that batch are plain code, reported side by side in the
same report: the file integrity of every shard (sha256 and size against the manifest) and the
balance of the train shards. Failures raise ``DataValidationError`` listing each one.
"""
from __future__ import annotations

import json
import logging
import math
import tempfile
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from common import storage
from data_checks.errors import DataError, DataValidationError
from common.manifest import download_shard, load_manifest, manifest_digest, manifest_uri, shards_prefix

if TYPE_CHECKING:
    import pandas as pd

    from training.config import TrainConfig

log = logging.getLogger(__name__)

REPORT_NAME = "validation.json"
NONFINITE_COLUMN = "_nonfinite_features"
_RESERVED = ("label", "row_id", "shard", "split", NONFINITE_COLUMN)
_EXAMPLES = 5
# Rows described value by value in the non-finite column; further bad rows are only counted.
_DESCRIBED_ROWS = 200


def validate_shards(manifest_prefix: str, cfg: "TrainConfig", *, report_prefix: str | None = None) -> dict[str, Any]:
    """Validate every shard of the manifest under ``manifest_prefix``.

    Returns ``{success, evaluated, failed, report_uri, manifest_digest, seconds}``; raises
    ``DataValidationError`` when any expectation or check fails (after writing the report).
    """
    started = time.monotonic()
    manifest = load_manifest(manifest_prefix)
    prefix = shards_prefix(manifest_prefix)
    loaded, integrity = _load_shards(manifest, prefix)
    checks = [integrity]
    ge_result: dict[str, Any] | None = None
    nonfinite: dict[str, int] = {}
    if integrity["success"]:
        frame, features, nonfinite = _frame(manifest, loaded)
        ge_result = _run_suite(frame, manifest, features)
        checks += [_balance_check(loaded, manifest, cfg), _shard_layout_check(manifest, cfg)]

    failures = _ge_failures(ge_result, nonfinite) + [f for c in checks if not c["success"] for f in c["failures"]]
    evaluated = len(checks) + (len(ge_result["results"]) if ge_result else 0)
    seconds = round(time.monotonic() - started, 3)
    report = {
        "success": not failures,
        "manifest_uri": manifest_uri(prefix),
        "manifest_digest": manifest_digest(manifest),
        "validated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": seconds,
        "evaluated": evaluated,
        "failures": failures,
        "checks": checks,
        "great_expectations": ge_result if ge_result is not None else
        {"skipped": "shard files failed their integrity check; their contents were not loaded"},
    }
    report_uri = None
    if report_prefix:
        report_uri = storage.join(report_prefix, REPORT_NAME)
        storage.put_bytes(report_uri, json.dumps(_jsonable(report), indent=2, sort_keys=True).encode())
    summary = {"success": not failures, "evaluated": evaluated, "failed": len(failures),
               "report_uri": report_uri, "manifest_digest": report["manifest_digest"], "seconds": seconds}
    if failures:
        raise DataValidationError(_message(prefix, failures, evaluated, report_uri), failures, report_uri)
    log.info("shards under %s passed %d checks in %.2f s", prefix, evaluated, seconds)
    return summary


# ---------------------------------------------------------------------------------------------
# Loading


def _load_shards(manifest: dict[str, Any], prefix: str) -> tuple[dict[str, tuple], dict[str, Any]]:
    """Download, verify and decode every shard; integrity problems become a failed check."""
    from common.records import read_all

    loaded: dict[str, tuple] = {}
    problems: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="validate-") as tmp:
        for shard in manifest["shards"]:
            name = shard["name"]
            try:
                idx, rec = download_shard(manifest, prefix, name, tmp)
                X, y, ids = read_all(idx, rec, manifest["num_features"])
            except (DataError, ValueError) as exc:  # ValueError: a record of the wrong width
                problems.append({"expectation": "shard_files_match_manifest", "column": None, "shard": name,
                                 "unexpected_count": 1, "examples": [str(exc)], "message": f"{name}: {exc}"})
                continue
            if len(y) != shard["count"]:
                problems.append({"expectation": "shard_files_match_manifest", "column": None, "shard": name,
                                 "unexpected_count": abs(len(y) - shard["count"]), "examples": [],
                                 "message": f"{name}: holds {len(y)} records, manifest says {shard['count']}"})
            loaded[name] = (shard["split"], X, y, ids)
    check = {"check": "shard_files_match_manifest", "success": not problems,
             "description": "every shard file exists and matches the manifest's size and sha256",
             "shards": len(manifest["shards"]), "failures": problems}
    return loaded, check


def _frame(manifest: dict[str, Any], loaded: dict[str, tuple]) -> tuple["pd.DataFrame", list[str], dict[str, int]]:
    """One frame of all rows: label, row_id, shard, split, the features, and the non-finite marker.

    Also returns how many non-finite values each feature column has (for the failure report).
    """
    import pandas as pd

    features = list(manifest["feature_columns"])
    if any(c in _RESERVED for c in features) or len(set(features)) != len(features):
        features = [f"f{i}" for i in range(manifest["num_features"])]
    width = manifest["num_features"]
    X = np.concatenate([v[1] for v in loaded.values()]) if loaded else np.empty((0, width), np.float32)
    y = np.concatenate([v[2] for v in loaded.values()]) if loaded else np.empty(0, np.int32)
    ids = np.concatenate([v[3] for v in loaded.values()]) if loaded else np.empty(0, np.int64)
    sizes = [len(v[2]) for v in loaded.values()]
    shard = np.repeat(np.array(list(loaded), dtype=object), sizes)
    split = np.repeat(np.array([v[0] for v in loaded.values()], dtype=object), sizes)
    frame = pd.concat([
        pd.DataFrame({"label": y, "row_id": ids, "shard": shard, "split": split}),
        pd.DataFrame(X, columns=features),
        pd.DataFrame({NONFINITE_COLUMN: _nonfinite_column(X, ids, list(manifest["feature_columns"]))}),
    ], axis=1)
    per_column = (~np.isfinite(X)).sum(axis=0)
    names = manifest["feature_columns"]
    return frame, features, {names[j]: int(per_column[j]) for j in np.flatnonzero(per_column)}


def _nonfinite_column(X: np.ndarray, ids: np.ndarray, names: list[str]) -> np.ndarray:
    """Per row: None when every feature is finite, else which features are not ("row 5: a=nan").

    Why a derived column: ``expect_column_values_to_not_be_null`` catches NaN but not inf, and
    ``expect_column_values_to_be_between`` catches inf but skips NaN (GE treats NaN as missing),
    so per-feature checks need two expectations per column — about 3 s of GE overhead for 64
    features, growing with the width. One expectation on this column costs the same at any
    width and its unexpected values name the columns, the values and the source rows.
    """
    bad = ~np.isfinite(X)
    out = np.full(len(X), None, dtype=object)
    bad_rows = np.flatnonzero(bad.any(axis=1))
    out[bad_rows[_DESCRIBED_ROWS:]] = "non-finite"
    for i in bad_rows[:_DESCRIBED_ROWS]:
        cols = np.flatnonzero(bad[i])
        shown = ", ".join(f"{names[j]}={X[i, j]}" for j in cols[:_EXAMPLES])
        more = f" (+{len(cols) - _EXAMPLES} more)" if len(cols) > _EXAMPLES else ""
        out[i] = f"row {ids[i]}: {shown}{more}"
    return out


# ---------------------------------------------------------------------------------------------
# Great Expectations


def _run_suite(frame: "pd.DataFrame", manifest: dict[str, Any], features: list[str]) -> dict[str, Any]:
    """Build an ephemeral GE context, one batch of ``frame``, one suite; run it once."""
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch_definition = (context.data_sources.add_pandas("shards")
                        .add_dataframe_asset("rows")
                        .add_batch_definition_whole_dataframe("all_rows"))
    total_rows = sum(s["count"] for s in manifest["splits"].values())
    suite = context.suites.add(gx.ExpectationSuite(name="shards", expectations=[
        gxe.ExpectTableColumnsToMatchOrderedList(
            column_list=["label", "row_id", "shard", "split", *features, NONFINITE_COLUMN],
            description="columns match the manifest's schema"),
        gxe.ExpectTableRowCountToBeBetween(min_value=1, description="the shards hold rows"),
        gxe.ExpectColumnDistinctValuesToEqualSet(
            column="shard", value_set=[s["name"] for s in manifest["shards"]],
            description="every shard in the manifest holds at least one row"),
        gxe.ExpectColumnValuesToBeNull(
            column=NONFINITE_COLUMN, description="every feature is finite (no NaN, no inf)"),
        gxe.ExpectColumnValuesToBeInSet(
            column="label", value_set=list(range(manifest["num_classes"])),
            description=f"labels are class indices 0..{manifest['num_classes'] - 1}"),
        gxe.ExpectColumnValuesToBeUnique(column="row_id", description="no source row appears twice"),
        gxe.ExpectColumnValuesToBeBetween(
            column="row_id", min_value=0, max_value=max(total_rows - 1, 0),
            description="row ids point into the source table"),
    ]))
    validation = context.validation_definitions.add(
        gx.ValidationDefinition(name="shards", data=batch_definition, suite=suite))
    result = validation.run(batch_parameters={"dataframe": frame},
                            result_format={"result_format": "SUMMARY", "partial_unexpected_count": 10})
    return result.to_json_dict()


def _ge_failures(ge_result: dict[str, Any] | None, nonfinite: dict[str, int]) -> list[dict[str, Any]]:
    if not ge_result:
        return []
    failures = []
    for r in ge_result["results"]:
        if r["success"]:
            continue
        cfg, res = r["expectation_config"], r.get("result") or {}
        column = cfg["kwargs"].get("column")
        examples = (res.get("partial_unexpected_list") or res.get("partial_missing_list") or [])[:_EXAMPLES]
        failure = {
            "expectation": cfg["type"],
            "column": column,
            "description": cfg.get("description"),
            "element_count": res.get("element_count"),
            "unexpected_count": res.get("unexpected_count"),
            "examples": examples,
        }
        if res.get("missing_count"):  # set expectations: values that should be there and are not
            failure["missing_count"] = res["missing_count"]
        if "observed_value" in res:
            failure["observed_value"] = res["observed_value"]
        if (r.get("exception_info") or {}).get("raised_exception"):
            failure["exception"] = r["exception_info"]["exception_message"]
        if column == NONFINITE_COLUMN:
            failure["columns"] = list(nonfinite)
            failure["column_counts"] = nonfinite
        failures.append(failure)
    return failures


# ---------------------------------------------------------------------------------------------
# Plain checks, reported beside the GE results


def _balance_check(loaded: dict[str, tuple], manifest: dict[str, Any], cfg: "TrainConfig") -> dict[str, Any]:
    """No train shard holds more than ``max_shard_imbalance`` × the mean (or more than ceil(mean),
    the least any split can achieve, so tiny datasets are not failed for being indivisible)."""
    counts = {n: len(v[2]) for n, v in loaded.items() if v[0] == "train"}
    mean = sum(counts.values()) / len(counts) if counts else 0.0
    limit = max(cfg.data.max_shard_imbalance * mean, math.ceil(mean))
    over = {n: c for n, c in counts.items() if c > limit}
    failures = [{
        "expectation": "train_shards_balanced", "column": "shard", "unexpected_count": len(over),
        "examples": [f"{n}: {c} rows" for n, c in list(over.items())[:_EXAMPLES]],
        "message": f"{len(over)} train shard(s) hold more than {limit:.1f} rows "
                   f"({cfg.data.max_shard_imbalance} × mean {mean:.1f})",
    }] if over else []
    return {"check": "train_shards_balanced", "success": not over, "counts": counts, "mean": mean,
            "limit": limit, "max_shard_imbalance": cfg.data.max_shard_imbalance,
            "description": "no train shard holds more than max_shard_imbalance × the mean", "failures": failures}


def _shard_layout_check(manifest: dict[str, Any], cfg: "TrainConfig") -> dict[str, Any]:
    """The manifest has the train shards the config asks for (one per worker unless set)."""
    n_train = sum(1 for s in manifest["shards"] if s["split"] == "train")
    ok = n_train == cfg.num_train_shards
    failures = [] if ok else [{
        "expectation": "train_shard_count_matches_config", "column": None, "unexpected_count": 1,
        "examples": [], "observed_value": n_train,
        "message": f"manifest has {n_train} train shards, the config asks for {cfg.num_train_shards}",
    }]
    return {"check": "train_shard_count_matches_config", "success": ok, "observed": n_train,
            "expected": cfg.num_train_shards, "failures": failures}


# ---------------------------------------------------------------------------------------------
# Reporting


def _message(prefix: str, failures: list[dict[str, Any]], evaluated: int, report_uri: str | None) -> str:
    lines = [f"shard validation failed for {prefix}: {len(failures)} of {evaluated} checks failed"]
    for f in failures:
        if "message" in f:
            lines.append(f"- {f['expectation']}: {f['message']}")
            continue
        where = f"({f['column']})" if f.get("column") else ""
        text = f"- {f['expectation']}{where}"
        if f.get("description"):
            text += f" [{f['description']}]"
        if f.get("column_counts"):
            shown = [f"{c} ({n})" for c, n in list(f["column_counts"].items())[:10]]
            more = f" and {len(f['column_counts']) - 10} more" if len(f["column_counts"]) > 10 else ""
            text += f": columns {', '.join(shown)}{more}"
        if f.get("unexpected_count") is not None:
            of = f" of {f['element_count']}" if f.get("element_count") is not None else ""
            text += f"; {f['unexpected_count']}{of} unexpected"
        if f.get("missing_count"):
            text += f"; {f['missing_count']} missing"
        if f.get("observed_value") is not None:
            text += f"; observed {_short(f['observed_value'])}"
        if f.get("examples"):
            text += f"; e.g. {_short(f['examples'])}"
        if f.get("exception"):
            text += f"; error: {f['exception']}"
        lines.append(text)
    if report_uri:
        lines.append(f"full report: {report_uri}")
    return "\n".join(lines)


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _jsonable(value: Any) -> Any:
    """Strict JSON: NaN/inf become strings, numpy scalars become Python ones."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
