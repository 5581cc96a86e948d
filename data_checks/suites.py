"""Great Expectations suites, one function per dataset kind, and the code that runs them.

GX 1.x, code-first: an ephemeral context is built when a validation runs (never at import or
DAG-parse time), with one pandas batch (one shard) and one suite. Optionally the run goes
through a Checkpoint with ``UpdateDataDocsAction`` into a throw-away local Data Docs site, and
the rendered validation page is kept (it costs about a second per shard).

Why derived columns (``_nonfinite_features``, ``_out_of_range``) rather than one expectation
per feature: ``expect_column_values_to_not_be_null`` catches NaN but not inf, and
``expect_column_values_to_be_between`` catches inf but skips NaN (GX treats NaN as missing), so
per-feature checks need two expectations per column — about 3 s of GX overhead for 64
features, growing with the width. One expectation on a derived column costs the same at any
width, and its unexpected values name the columns, the values and the source rows.
"""
from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

NONFINITE_COLUMN = "_nonfinite_features"
RANGE_COLUMN = "_out_of_range"
# Regression: the same derived columns for the float targets (they replace the class label).
NONFINITE_TARGETS_COLUMN = "_nonfinite_targets"
TARGET_RANGE_COLUMN = "_targets_out_of_range"
EXAMPLES = 5
# Rows described value by value in a derived column; further bad rows are only marked.
_DESCRIBED_ROWS = 200


@dataclass(frozen=True)
class SuiteSpec:
    """What a shard's batch must look like; built from the manifest and the config."""

    shard: str
    columns: list[str]  # the batch's columns, in order
    expected_rows: int
    allowed_labels: int  # labels are class indices 0..allowed_labels-1
    total_rows: int  # row ids point into the source: 0..total_rows-1
    has_ids: bool
    value_range: tuple[float, float] | None
    num_features: int
    # Regression (model.task='regression'): how many float targets, and their declared range.
    num_targets: int = 0
    target_range: tuple[float, float] | None = None


def _common(spec: SuiteSpec) -> list[Any]:
    import great_expectations.expectations as gxe

    out = [
        gxe.ExpectTableColumnsToMatchOrderedList(column_list=spec.columns,
                                                 description="columns match the manifest's schema"),
        gxe.ExpectTableRowCountToBeBetween(min_value=1, description="the shard holds rows"),
        gxe.ExpectTableRowCountToEqual(value=spec.expected_rows,
                                       description="the shard holds the manifest's record count"),
        gxe.ExpectColumnValuesToBeOfType(column="row_id", type_="int64", description="row ids are integers"),
        gxe.ExpectColumnValuesToBeNull(column=NONFINITE_COLUMN,
                                       description="every feature is finite (no null, NaN or inf)"),
        *(_target_expectations(spec) if spec.num_targets else _label_expectations(spec)),
        gxe.ExpectColumnValuesToBeUnique(column="row_id", description="no source row appears twice"),
        gxe.ExpectColumnValuesToBeBetween(column="row_id", min_value=0, max_value=max(spec.total_rows - 1, 0),
                                          description="row ids point into the source table"),
    ]
    if spec.has_ids:
        out.append(gxe.ExpectColumnValuesToBeUnique(column="id_hash", description="no id appears twice"))
    return out


def _label_expectations(spec: SuiteSpec) -> list[Any]:
    """Classification: labels are class indices of the (declared) label set."""
    import great_expectations.expectations as gxe

    return [gxe.ExpectColumnValuesToBeOfType(column="label", type_="int32", description="labels are class indices"),
            gxe.ExpectColumnValuesToBeInSet(column="label", value_set=list(range(spec.allowed_labels)),
                                            description="labels are within the declared label set")]


def _target_expectations(spec: SuiteSpec) -> list[Any]:
    """Regression: every target is finite and, if ``data.target_range`` is declared, inside it."""
    import great_expectations.expectations as gxe

    out = [gxe.ExpectColumnValuesToBeNull(column=NONFINITE_TARGETS_COLUMN,
                                          description="every target is finite (no null, NaN or inf)")]
    if spec.target_range is not None:
        lo, hi = spec.target_range
        out.append(gxe.ExpectColumnValuesToBeNull(column=TARGET_RANGE_COLUMN,
                                                  description=f"every target is within [{lo}, {hi}]"))
    return out


def table_suite(spec: SuiteSpec) -> list[Any]:
    """Tabular sources: the common checks, plus the declared ``data.feature_range`` if any."""
    import great_expectations.expectations as gxe

    out = _common(spec)
    if spec.value_range is not None:
        lo, hi = spec.value_range
        out.append(gxe.ExpectColumnValuesToBeNull(column=RANGE_COLUMN,
                                                  description=f"every feature is within [{lo}, {hi}]"))
    return out


def image_suite(spec: SuiteSpec) -> list[Any]:
    """Image sources: the common checks, pixels scaled into [0, 1], C×H×W values per image."""
    import great_expectations.expectations as gxe

    lo, hi = spec.value_range or (0.0, 1.0)
    return [*_common(spec),
            gxe.ExpectColumnValuesToBeNull(column=RANGE_COLUMN, description=f"every pixel is within [{lo}, {hi}]"),
            gxe.ExpectTableColumnCountToEqual(value=len(spec.columns),
                                              description=f"each image has {spec.num_features} values (C×H×W)")]


SUITES: dict[str, Callable[[SuiteSpec], list[Any]]] = {"table": table_suite, "images": image_suite}


def _import_gx() -> Any:
    """Great Expectations, with its INFO records off and its warnings kept.

    GX logs at INFO what only its own developers need, about 260 lines per validation: "Skipping
    registering function …" from its public-API decorator (``great_expectations._docs_decorators``)
    for every function it imports, then per context "Loading 'datasources'", "Created temporary
    directory …" and "_get_default_value called with key …" per expectation. The level must be
    set before the import (the decorator logs as modules load); ``data_context.types.base`` sets
    its own logger to INFO when it loads, so that one is set again after it.
    """
    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    import great_expectations as gx
    import great_expectations.data_context.types.base as gx_base

    logging.getLogger(gx_base.__name__).setLevel(logging.WARNING)
    return gx


class SuiteRunner:
    """One ephemeral GX context for the batches of one shard (validated a chunk at a time): the
    suite of ``kind`` is built once per distinct ``SuiteSpec`` (the chunks differ only in their
    expected row count, so at most a few), then run on each batch."""

    def __init__(self, kind: str) -> None:
        self.gx = _import_gx()  # first: it quiets GX's loggers before any GX module loads
        from great_expectations.data_context.types.base import ProgressBarsConfig

        self.kind = kind
        self.context = self.gx.get_context(mode="ephemeral")
        self.context.variables.progress_bars = ProgressBarsConfig(globally=False)
        self._source = self.context.data_sources.add_pandas("shards")
        self._validations: dict[str, Any] = {}

    def validation(self, spec: SuiteSpec) -> Any:
        """The validation definition of ``spec``'s suite, added on first use."""
        key = repr(spec)
        if key not in self._validations:
            n = len(self._validations)
            name = spec.shard if n == 0 else f"{spec.shard}-{n}"
            batch_definition = self._source.add_dataframe_asset(name).add_batch_definition_whole_dataframe("rows")
            suite = self.context.suites.add(self.gx.ExpectationSuite(name=f"{self.kind}-shard-{n}",
                                                                     expectations=SUITES[self.kind](spec)))
            self._validations[key] = self.context.validation_definitions.add(
                self.gx.ValidationDefinition(name=f"validate-{name}", data=batch_definition, suite=suite))
        return self._validations[key]

    def run(self, spec: SuiteSpec, frame: "pd.DataFrame") -> dict[str, Any]:
        """The GX result (as JSON) of ``spec``'s suite on ``frame``."""
        return self.validation(spec).run(batch_parameters={"dataframe": frame},
                                         result_format=RESULT_FORMAT).to_json_dict()


RESULT_FORMAT = {"result_format": "SUMMARY", "partial_unexpected_count": 10}


def run_suite(kind: str, spec: SuiteSpec, frame: "pd.DataFrame", docs_dir: str | None = None) -> tuple[dict[str, Any], str | None]:
    """Run the suite of ``kind`` on ``frame``; returns (GX result as JSON, Data Docs page or None)."""
    runner = SuiteRunner(kind)
    if docs_dir is None:
        return runner.run(spec, frame), None
    gx, context, validation = runner.gx, runner.context, runner.validation(spec)
    context.add_data_docs_site(site_name="local", site_config={
        "class_name": "SiteBuilder",
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": docs_dir},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"}})
    checkpoint = context.checkpoints.add(gx.Checkpoint(
        name=f"checkpoint-{spec.shard}", validation_definitions=[validation], result_format=RESULT_FORMAT,
        actions=[gx.checkpoint.UpdateDataDocsAction(name="data_docs", site_names=["local"])]))
    run = checkpoint.run(batch_parameters={"dataframe": frame})
    result = next(iter(run.run_results.values()))
    pages = glob.glob(os.path.join(docs_dir, "validations", "**", "*.html"), recursive=True)
    return result.to_json_dict(), (pages[0] if pages else None)


def merge_results(results: list[dict[str, Any]], expected_rows: int) -> dict[str, Any]:
    """One GX result of a shard from its chunks' results (the same suite but for each chunk's
    expected row count, run on consecutive chunks): an expectation succeeds when it did on
    every chunk; element, unexpected and missing counts add up, the unexpected examples are the
    first chunks' (at most ``RESULT_FORMAT``'s count), the row count's observed value is the
    shard's and its expected value the manifest's (``expected_rows``). Uniqueness across chunks
    is not in here: the caller checks it on the whole shard's ids (``mark_duplicates``)."""
    import copy

    merged = copy.deepcopy(results[0])
    limit = RESULT_FORMAT["partial_unexpected_count"]
    for k, first in enumerate(merged["results"]):
        each = [r["results"][k] for r in results]
        first["success"] = all(e["success"] for e in each)
        kind = first["expectation_config"]["type"]
        res = first.get("result") or {}
        if kind == "expect_table_row_count_to_equal":
            first["expectation_config"]["kwargs"]["value"] = expected_rows
            res["observed_value"] = sum(int((e.get("result") or {}).get("observed_value") or 0) for e in each)
            first["success"] = res["observed_value"] == expected_rows
        elif kind == "expect_table_row_count_to_be_between":
            res["observed_value"] = sum(int((e.get("result") or {}).get("observed_value") or 0) for e in each)
            first["success"] = res["observed_value"] >= 1
        for count in ("element_count", "unexpected_count", "missing_count"):
            if count in res:
                res[count] = sum(int((e.get("result") or {}).get(count) or 0) for e in each)
        if "partial_unexpected_list" in res:
            listed = [(e.get("result") or {}).get("partial_unexpected_list") or [] for e in each]
            res["partial_unexpected_list"] = [v for values in listed for v in values][:limit]
        for pct, base in (("unexpected_percent", "element_count"), ("missing_percent", "element_count")):
            if pct in res and res.get(base):
                res[pct] = 100.0 * res[pct.replace("percent", "count")] / res[base]
        failed = next((e for e in each if (e.get("exception_info") or {}).get("raised_exception")), None)
        if failed is not None:
            first["exception_info"] = failed["exception_info"]
    _restate(merged)
    return merged


def mark_duplicates(result: dict[str, Any], column: str, values: np.ndarray) -> None:
    """Fail ``result``'s uniqueness expectation of ``column`` when ``values`` (the whole shard's,
    gathered chunk by chunk) repeat a value: what the chunks alone cannot see."""
    unique, counts = np.unique(values, return_counts=True)
    repeated = unique[counts > 1]
    if not len(repeated):
        return
    for r in result["results"]:
        config = r["expectation_config"]
        if config["type"] == "expect_column_values_to_be_unique" and config["kwargs"].get("column") == column:
            res = r.setdefault("result", {})
            extra = int(counts[counts > 1].sum())
            if r["success"]:  # no chunk saw a duplicate: every repeated row counts
                res["unexpected_count"] = extra
                shown = repeated[:RESULT_FORMAT["partial_unexpected_count"]]
                res["partial_unexpected_list"] = [v.item() for v in shown]
            else:  # some were seen within a chunk: the whole shard's count replaces the chunks' sum
                res["unexpected_count"] = extra
            if res.get("element_count"):
                res["unexpected_percent"] = 100.0 * extra / res["element_count"]
            r["success"] = False
    _restate(result)


def _restate(result: dict[str, Any]) -> None:
    """The result's overall success and statistics from its expectations'."""
    ok = sum(bool(r["success"]) for r in result["results"])
    total = len(result["results"])
    result["success"] = ok == total
    stats = result.setdefault("statistics", {})
    stats.update(evaluated_expectations=total, successful_expectations=ok, unsuccessful_expectations=total - ok,
                 success_percent=100.0 * ok / total if total else None)


def describe_rows(bad: np.ndarray, X: np.ndarray, ids: np.ndarray, names: list[str], label: str) -> np.ndarray:
    """A derived column: None for good rows, else which features are bad ("row 5: a=nan").

    ``bad`` is a boolean matrix like ``X``; ``label`` marks rows past the described ones.
    """
    out = np.full(len(X), None, dtype=object)
    bad_rows = np.flatnonzero(bad.any(axis=1))
    out[bad_rows[_DESCRIBED_ROWS:]] = label
    for i in bad_rows[:_DESCRIBED_ROWS]:
        cols = np.flatnonzero(bad[i])
        shown = ", ".join(f"{names[j]}={X[i, j]}" for j in cols[:EXAMPLES])
        more = f" (+{len(cols) - EXAMPLES} more)" if len(cols) > EXAMPLES else ""
        out[i] = f"row {ids[i]}: {shown}{more}"
    return out


def ge_failures(ge_result: dict[str, Any], column_counts: dict[str, dict[str, int]],
                classes: list[Any]) -> list[dict[str, Any]]:
    """One failure dict per failed expectation: type, column, counts, examples."""
    failures = []
    for r in ge_result["results"]:
        if r["success"]:
            continue
        cfg, res = r["expectation_config"], r.get("result") or {}
        column = cfg["kwargs"].get("column")
        examples = (res.get("partial_unexpected_list") or res.get("partial_missing_list") or [])[:EXAMPLES]
        failure: dict[str, Any] = {"expectation": cfg["type"], "column": column, "description": cfg.get("description"),
                                   "element_count": res.get("element_count"),
                                   "unexpected_count": res.get("unexpected_count"), "examples": examples}
        if res.get("missing_count"):
            failure["missing_count"] = res["missing_count"]
        if "observed_value" in res:
            failure["observed_value"] = res["observed_value"]
        if (r.get("exception_info") or {}).get("raised_exception"):
            failure["exception"] = r["exception_info"]["exception_message"]
        if column in column_counts:
            failure["columns"] = list(column_counts[column])
            failure["column_counts"] = column_counts[column]
        if column == "label" and cfg["type"] == "expect_column_values_to_be_in_set":
            failure["values"] = [classes[int(v)] if 0 <= int(v) < len(classes) else v for v in examples]
        failures.append(failure)
    return failures
