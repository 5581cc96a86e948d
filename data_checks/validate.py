"""Validate committed shards: one Great Expectations run per shard, then cross-shard checks.

``validate_shard`` checks one shard (memory: a chunk of it, ``CHUNK_BYTES``) — file integrity against the manifest
(size + sha256), then the GX suite of the dataset's kind (``suites``) — and never raises for
bad data: it returns a result. In Airflow it is one mapped task per shard;
``finish_validation`` is the task after them: it reads the per-shard results, runs the
cross-shard checks (``cross``), writes ``validation.json`` + ``validation.html`` and raises
``DataValidationError`` listing every failure. ``validate_shards`` does both in one process
(CLI, tests).

Report layout under the report prefix: ``shards/{name}.json`` (+ ``.html``: the GX Data Docs
page; + ``.ids.npy``: id hashes for the cross-shard duplicate check), ``validation.json``,
``validation.html``.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from common import storage
from common.manifest import download_shard, is_regression, load_manifest, record_width, shards_prefix
from common.preprocessing import numeric_bounds, raw_numbers
from data_checks import report as reporting
from data_checks.cross import cross_shard_checks
from data_checks.errors import DataError, DataValidationError
from data_checks.suites import (NONFINITE_COLUMN, NONFINITE_TARGETS_COLUMN, RANGE_COLUMN, TARGET_RANGE_COLUMN,
                                SuiteRunner, SuiteSpec, describe_rows, ge_failures, mark_duplicates, merge_results,
                                run_suite)

if TYPE_CHECKING:
    import pandas as pd

    from common.config import TrainConfig

log = logging.getLogger(__name__)

REPORT_NAME = reporting.REPORT_NAME
_RESERVED = ("label", "row_id", "id_hash", NONFINITE_COLUMN, RANGE_COLUMN, NONFINITE_TARGETS_COLUMN,
             TARGET_RANGE_COLUMN)


@dataclass
class ShardOutcome:
    result: dict[str, Any]  # JSON-able: success, failures, checks, GX result, stats
    ids: np.ndarray | None  # [n, 2] uint64: (id hash, row id), for the cross-shard duplicate check


# Bytes of records validated at a time: a shard is read and checked in chunks of this many bytes,
# so a task's memory follows the chunk, not the shard (which grows with the table). About a
# second of GX per chunk; a shard of at most one chunk is one GX run, as before.
CHUNK_BYTES = 64 << 20


def validate_shard(manifest_prefix: str, shard_name: str, cfg: "TrainConfig", *,
                   manifest: dict[str, Any] | None = None, docs: bool = False,
                   chunk_bytes: int = CHUNK_BYTES) -> ShardOutcome:
    """Validate one shard, a chunk of ``chunk_bytes`` of records at a time; bad data gives
    ``success=False`` with the failures listed.

    Each chunk is one GX run of the shard's suite (expecting the rows the manifest puts in that
    chunk); the results merge into the shard's (``suites.merge_results``), and the row ids (and
    id hashes) of the whole shard are checked for repeats across chunks (``suites.mark_duplicates``):
    memory is one chunk plus 8 bytes a row (16 with an id column). The Data Docs page (``docs``)
    is rendered for a shard of one chunk only."""
    started = time.monotonic()
    manifest = manifest or load_manifest(manifest_prefix)
    prefix = shards_prefix(manifest_prefix)
    entry = next((s for s in manifest["shards"] if s["name"] == shard_name), None)
    if entry is None:
        raise DataError(f"shard {shard_name!r} is not in the manifest under {prefix}")
    from common import record_codec

    result: dict[str, Any] = {"shard": shard_name, "split": entry["split"], "expected_rows": entry["count"]}
    width = record_width(manifest)
    rows_per_chunk = max(1, chunk_bytes // record_codec.record_bytes(width))
    kind = manifest.get("source_kind", "table")
    with tempfile.TemporaryDirectory(prefix="validate-") as tmp:
        try:
            idx, rec = download_shard(manifest, prefix, shard_name, tmp)
            blocks = record_codec.iter_blocks(idx, rec, width, rows_per_chunk)
            first = next(blocks, None)
        except (DataError, ValueError) as exc:  # ValueError: a record of the wrong width
            return _files_failed(result, shard_name, exc, started)
        if first is None:  # an empty shard: one empty batch, which the suite fails
            first = record_codec.Shard(np.empty((0, width), np.float32), np.empty(0, np.int32),
                                       np.empty(0, np.int64), np.empty(0, np.uint64))
        runner, results, tally, html, start = SuiteRunner(kind), [], _Tally(), None, 0
        for shard in _chain(first, blocks):
            frame, spec, chunk_counts = _frame(manifest, entry, shard, cfg)
            # This chunk's share of the manifest's count: a short or long shard fails in its last chunk.
            spec = dataclasses.replace(spec, expected_rows=max(0, min(rows_per_chunk, entry["count"] - start)))
            if docs and entry["count"] <= rows_per_chunk:
                ge_chunk, page = run_suite(kind, spec, frame, docs_dir=os.path.join(tmp, "docs"))
                html = open(page).read() if page else None
            else:
                ge_chunk = runner.run(spec, frame)
            del frame
            results.append(ge_chunk)
            tally.add(shard, chunk_counts, spec.has_ids)
            start += len(shard.labels)
    ge_result = results[0] if len(results) == 1 else merge_results(results, entry["count"])
    all_rows = np.concatenate(tally.row_ids)
    if len(results) > 1:
        mark_duplicates(ge_result, "row_id", all_rows)
        if spec.has_ids:
            mark_duplicates(ge_result, "id_hash", np.concatenate(tally.hashes))
    failures = ge_failures(ge_result, tally.counts, manifest["classes"])
    label_counts, label_rows = tally.label_counts, tally.label_rows
    observed = {str(k): label_counts[k] for k in sorted(label_counts)}
    hist_check = _histogram_check(entry, observed)
    failures += hist_check["failures"]
    result.update(success=not failures, rows=len(all_rows), failures=failures,
                  evaluated=len(ge_result["results"]) + 2, checks=[_integrity(True, []), hist_check],
                  label_histogram=observed,
                  # a source row of each class, for examples of labels that look accidental
                  label_rows={str(k): label_rows[k] for k in sorted(label_rows)},
                  great_expectations=ge_result, chunks=len(results))
    if html is not None:
        result["_html"] = html
    ids = np.stack([np.concatenate(tally.hashes), all_rows.astype(np.uint64)], axis=1) if spec.has_ids else None
    return ShardOutcome(_finish(result, started), ids)


@dataclasses.dataclass
class _Tally:
    """What a shard's chunks add up to: per-column counts of bad values, rows per label and a
    source row of each, the row ids and id hashes (checked for repeats across chunks)."""

    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    label_counts: dict[int, int] = dataclasses.field(default_factory=dict)
    label_rows: dict[int, int] = dataclasses.field(default_factory=dict)
    row_ids: list[np.ndarray] = dataclasses.field(default_factory=list)
    hashes: list[np.ndarray] = dataclasses.field(default_factory=list)

    def add(self, shard: Any, chunk_counts: dict[str, dict[str, int]], has_ids: bool) -> None:
        for column, per in chunk_counts.items():
            into = self.counts.setdefault(column, {})
            for name, n in per.items():
                into[name] = into.get(name, 0) + n
        labels, first_at, n_each = np.unique(shard.labels, return_index=True, return_counts=True)
        for k, i, n in zip(labels.tolist(), first_at.tolist(), n_each.tolist()):
            self.label_counts[k] = self.label_counts.get(k, 0) + n
            self.label_rows.setdefault(k, int(shard.row_ids[i]))
        self.row_ids.append(shard.row_ids.astype(np.int64))
        if has_ids:
            self.hashes.append(shard.id_hashes)


def _files_failed(result: dict[str, Any], shard_name: str, exc: Exception, started: float) -> ShardOutcome:
    """The outcome of a shard whose files do not match the manifest: one integrity failure, no GX run."""
    problem = {"expectation": "shard_files_match_manifest", "column": None, "shard": shard_name,
               "unexpected_count": 1, "examples": [str(exc)], "message": f"{shard_name}: {exc}"}
    result.update(success=False, rows=0, evaluated=1, failures=[problem], checks=[_integrity(False, [problem])],
                  great_expectations={"skipped": "the shard files failed their integrity check"})
    return ShardOutcome(_finish(result, started), None)


def _chain(first: Any, rest: Any) -> Any:
    yield first
    yield from rest


def _finish(result: dict[str, Any], started: float) -> dict[str, Any]:
    seconds = time.monotonic() - started
    result["seconds"] = round(seconds, 3)
    result["rows_per_s"] = round(result.get("rows", 0) / max(seconds, 1e-9), 1)
    level = logging.INFO if result["success"] else logging.WARNING
    log.log(level, "shard %s: %s (%d rows, %d failures, %.2f s, %.0f rows/s)", result["shard"],
            "passed" if result["success"] else "FAILED", result.get("rows", 0), len(result["failures"]),
            seconds, result["rows_per_s"])
    return result


def _integrity(ok: bool, failures: list[dict[str, Any]]) -> dict[str, Any]:
    return {"check": "shard_files_match_manifest", "success": ok, "failures": failures,
            "description": "the shard files exist and match the manifest's size and sha256"}


def _histogram_check(entry: dict[str, Any], observed: dict[str, int]) -> dict[str, Any]:
    """``observed``: the shard's rows per class index (as a string), counted chunk by chunk."""
    expected = entry.get("label_histogram") or observed  # hand-made manifests may leave it empty
    ok = observed == expected
    diff = sorted(k for k in set(observed) | set(expected) if observed.get(k) != expected.get(k))
    failures = [] if ok else [{
        "expectation": "label_histogram_matches_manifest", "column": "label", "unexpected_count": len(diff),
        "examples": [f"class {k}: {observed.get(k, 0)} rows, manifest says {expected.get(k, 0)}" for k in diff[:5]],
        "message": f"{entry['name']}: label histogram differs from the manifest in {len(diff)} classes"}]
    return {"check": "label_histogram_matches_manifest", "success": ok, "failures": failures,
            "description": "the shard's label histogram equals the manifest's"}


def _frame(manifest: dict[str, Any], entry: dict[str, Any], shard: Any,
           cfg: "TrainConfig") -> tuple["pd.DataFrame", SuiteSpec, dict[str, dict[str, int]]]:
    """The batch GX sees, the suite's parameters, and per-column counts for the derived columns."""
    import pandas as pd

    names = list(manifest["feature_columns"])
    features = names if not (set(names) & set(_RESERVED) or len(set(names)) != len(names)) else \
        [f"f{i}" for i in range(len(names))]
    regression = is_regression(manifest)
    X, ids = shard.features[:, :manifest["num_features"]], shard.row_ids
    has_ids = bool(manifest.get("id_column"))
    kind = manifest.get("source_kind", "table")
    value_range = tuple(cfg.data.feature_range) or ((0.0, 1.0) if kind == "images" else None)
    prep = manifest.get("preprocessing")
    # Regression: the float targets replace the class label (always 0 in their records' headers).
    label = {} if regression else {"label": shard.labels}
    parts = [pd.DataFrame({**label, "row_id": ids, **({"id_hash": shard.id_hashes} if has_ids else {})}),
             pd.DataFrame(X, columns=features, copy=False)]
    counts: dict[str, dict[str, int]] = {}
    bounds, shown = value_range, X
    if prep and value_range is not None:
        # The range is of raw values: compared as the transform maps them (float32, as X), and
        # reported as the raw values it is of.
        bounds = tuple(b.astype(np.float32) for b in numeric_bounds(prep, *value_range))
        shown = raw_numbers(prep, X).astype(np.float32)
    _derived(parts, counts, X, ids, names, bounds, NONFINITE_COLUMN, RANGE_COLUMN, shown=shown)
    target_range = tuple(cfg.data.target_range) or None
    if regression:
        _derived(parts, counts, shard.features[:, manifest["num_features"]:], ids, manifest["target_columns"],
                 target_range, NONFINITE_TARGETS_COLUMN, TARGET_RANGE_COLUMN)
    frame = pd.concat(parts, axis=1)
    declared = manifest.get("declared_classes")
    spec = SuiteSpec(shard=entry["name"], columns=list(frame.columns), expected_rows=entry["count"],
                     allowed_labels=len(declared) if declared else manifest["num_classes"],
                     total_rows=_total_rows(manifest), has_ids=has_ids,
                     value_range=value_range, num_features=manifest["num_features"],
                     num_targets=int(manifest.get("num_targets", 0)), target_range=target_range)
    return frame, spec, counts


def _derived(parts: list["pd.DataFrame"], counts: dict[str, dict[str, int]], X: np.ndarray, ids: np.ndarray,
             names: list[str], value_range: tuple[Any, Any] | None, nonfinite_column: str,
             range_column: str, shown: np.ndarray | None = None) -> None:
    """The derived columns of ``X`` (``suites``' docstring says why): its non-finite values and, if a
    range is declared, its values outside it (reported as ``shown``'s, default ``X``'s); each with
    per-column counts for the report."""
    import pandas as pd

    nonfinite = ~np.isfinite(X)
    parts.append(pd.DataFrame({nonfinite_column: describe_rows(nonfinite, X, ids, names, "non-finite")}))
    counts[nonfinite_column] = _per_column(nonfinite, names)
    if value_range is not None:
        with np.errstate(invalid="ignore"):
            outside = np.isfinite(X) & ((X < value_range[0]) | (X > value_range[1]))
        parts.append(pd.DataFrame({range_column: describe_rows(outside, X if shown is None else shown, ids, names,
                                                               "out of range")}))
        counts[range_column] = _per_column(outside, names)


def _per_column(bad: np.ndarray, names: list[str]) -> dict[str, int]:
    per_column = bad.sum(axis=0)
    return {names[j]: int(per_column[j]) for j in np.flatnonzero(per_column)}


def _total_rows(manifest: dict[str, Any]) -> int:
    return int((manifest.get("stats") or {}).get("rows") or sum(s["count"] for s in manifest["shards"]))


# ---------------------------------------------------------------------------------------------
# Per-shard results in storage (the mapped Airflow tasks hand them to the final one this way)


def save_outcome(outcome: ShardOutcome, report_prefix: str) -> dict[str, Any]:
    """Write a shard's result (+ Data Docs page, + id hashes) under ``{report_prefix}/shards/``."""
    result = dict(outcome.result)
    base = storage.join(report_prefix, "shards", result["shard"])
    html = result.pop("_html", None)
    if html is not None:
        storage.put_bytes(base + ".html", html.encode())
        result["html_uri"] = base + ".html"
    if outcome.ids is not None:
        buf = io.BytesIO()
        np.save(buf, outcome.ids)
        storage.put_bytes(base + ".ids.npy", buf.getvalue())
        result["ids_uri"] = base + ".ids.npy"
    result["report_uri"] = base + ".json"
    storage.put_bytes(result["report_uri"], json.dumps(reporting.jsonable(result), indent=2, sort_keys=True).encode())
    return result


def load_outcome(report_prefix: str, shard_name: str) -> ShardOutcome | None:
    base = storage.join(report_prefix, "shards", shard_name)
    try:
        result = json.loads(storage.get_bytes(base + ".json"))
    except FileNotFoundError:
        return None
    ids = np.load(io.BytesIO(storage.get_bytes(result["ids_uri"]))) if result.get("ids_uri") else None
    return ShardOutcome(result, ids)


# ---------------------------------------------------------------------------------------------
# The whole validation


def finish_validation(manifest_prefix: str, cfg: "TrainConfig", outcomes: dict[str, ShardOutcome | None], *,
                      report_prefix: str | None = None, previous_manifest_uri: str | None = None,
                      started: float | None = None) -> dict[str, Any]:
    """Cross-shard checks over the per-shard outcomes; write the report; raise on any failure."""
    started = time.monotonic() if started is None else started
    manifest = load_manifest(manifest_prefix)
    checks = cross_shard_checks(manifest, {k: (v.result if v else None) for k, v in outcomes.items()},
                                {k: v.ids for k, v in outcomes.items() if v is not None and v.ids is not None},
                                cfg, previous_manifest_uri)
    report = reporting.build(manifest, shards_prefix(manifest_prefix), outcomes, checks,
                             round(time.monotonic() - started, 3))
    uris = reporting.write(report, report_prefix) if report_prefix else {}
    summary = {"success": report["success"], "evaluated": report["evaluated"], "failed": len(report["failures"]),
               "warnings": [w.get("message") or w["expectation"] for w in report["warnings"]],
               "report_uri": uris.get("json"), "html_uri": uris.get("html"),
               "manifest_digest": report["manifest_digest"], "seconds": report["seconds"],
               "rows_per_s": report["rows_per_s"], "drift": report.get("drift"), "imputed": report["imputed"]}
    if report["failures"]:
        raise DataValidationError(reporting.message(report, uris.get("json")), report["failures"], uris.get("json"))
    for warning in summary["warnings"]:
        log.warning("validation warning: %s", warning)
    log.info("shards under %s passed %d checks in %.2f s", shards_prefix(manifest_prefix), report["evaluated"],
             report["seconds"])
    return summary


# ---------------------------------------------------------------------------------------------
# A pipeline run's validation: one step per shard, then one over all, the pointer last


def validate_run_shard(manifest_prefix: str, shard_name: str, cfg: "TrainConfig", report_prefix: str, *,
                       docs: bool = False) -> dict[str, Any]:
    """Validate one shard and save its result under ``report_prefix`` (``finish_run_validation``
    reads it from there); returns the saved result: ``success`` False is bad data."""
    return save_outcome(validate_shard(manifest_prefix, shard_name, cfg, docs=docs), report_prefix)


def finish_run_validation(manifest_prefix: str, cfg: "TrainConfig", shard_names: list[str], *, report_prefix: str,
                          latest_validated_uri: str, previous_manifest_uri: str | None = None,
                          **lineage: str) -> dict[str, Any]:
    """After every shard's ``validate_run_shard``: the cross-shard checks and the full report
    (``finish_validation``: raises ``DataValidationError`` on any failure), then, on success, the
    dataset's "last validated manifest" pointer at ``latest_validated_uri`` (with ``lineage``,
    e.g. the DAG and run ids), which the next run's drift check compares to."""
    from datetime import datetime, timezone

    from common.manifest import manifest_uri, write_pointer

    outcomes = {name: load_outcome(report_prefix, name) for name in shard_names}
    summary = finish_validation(manifest_prefix, cfg, outcomes, report_prefix=report_prefix,
                                previous_manifest_uri=previous_manifest_uri)
    write_pointer(latest_validated_uri, manifest_uri(manifest_prefix), load_manifest(manifest_prefix),
                  report_uri=summary["report_uri"], **lineage,
                  validated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return summary


def validate_shards(manifest_prefix: str, cfg: "TrainConfig", *, report_prefix: str | None = None,
                    previous_manifest_uri: str | None = None, docs: bool = False) -> dict[str, Any]:
    """Every shard, then the cross-shard checks, in this process (CLI, tests).

    Returns ``{success, evaluated, failed, warnings, report_uri, html_uri, manifest_digest,
    seconds, rows_per_s, drift, imputed}``; raises ``DataValidationError`` listing every failure (after
    writing the report).
    """
    started = time.monotonic()
    manifest = load_manifest(manifest_prefix)
    outcomes: dict[str, ShardOutcome | None] = {}
    for entry in manifest["shards"]:
        outcome = validate_shard(manifest_prefix, entry["name"], cfg, manifest=manifest, docs=docs)
        if report_prefix:
            outcome = ShardOutcome(save_outcome(outcome, report_prefix), outcome.ids)
        else:
            outcome.result.pop("_html", None)
        outcomes[entry["name"]] = outcome
    return finish_validation(manifest_prefix, cfg, outcomes, report_prefix=report_prefix,
                             previous_manifest_uri=previous_manifest_uri, started=started)
