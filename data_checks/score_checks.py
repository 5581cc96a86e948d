"""The checks a batch-scoring input passes before any row is scored: schema, then drift.

What the model expects comes from its training manifest (``common.manifest``): the raw input
columns and their kind (the preprocessing record's ``inputs``: numeric with the train split's
mean and std, categorical with the train split's categories; a manifest without preprocessing
gives the feature columns and no statistics), the id column, and whether a missing value was
imputed (``fill``) or is an error.

- ``check_schema`` reads only the files' headers (``score_input.plan_input``): every file must
  hold every input column (and the id column when training had one), and a numeric input must
  be numbers. Plain Python, not Great Expectations: it compares names and types from file
  headers, before any batch of rows exists.
- ``profile`` streams the input once (``score_input.read_rows``; memory: one chunk) into
  per-column counts, mean and variance (Chan's parallel update, as ``preprocess`` fits them),
  missing and non-finite values, and the categorical values the train split never had.
- ``check_drift`` turns the profile into one row per input column with derived columns that
  describe a problem or hold None, and runs a Great Expectations suite on that frame
  (``suites``' pattern: ``ExpectColumnValuesToBeNull`` on a derived column whose unexpected
  values name the columns). GX's pandas column aggregates (``ExpectColumnMeanToBeBetween``)
  would need the whole table in one frame, which a table larger than memory is not; the
  profile is what is small.

A failed check raises ``DataValidationError`` whose message names every bad column. numpy,
pandas and Great Expectations are imported inside the functions (the scoring DAG's Params come
from here at parse time).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from data_checks.errors import DataError, DataValidationError

if TYPE_CHECKING:
    import pandas as pd

    from data_checks.score_input import InputPlan

log = logging.getLogger(__name__)

# How far the input may be from the train split before scoring is refused (the DAG's ``drift``
# Param overrides each): the mean, in train standard deviations; the standard deviation, as a
# ratio either way; the share of a categorical column's values the train split never had.
DEFAULT_DRIFT = {"max_mean_shift": 0.5, "max_std_ratio": 2.0, "max_unseen_share": 0.05}
DRIFT_SCHEMA = {"type": "object", "additionalProperties": False,
                "properties": {k: {"type": "number", "exclusiveMinimum": 0} for k in DEFAULT_DRIFT}}
_NUMERIC_TYPES = ("int", "uint", "float", "double", "halffloat", "bool", "decimal", "null")
_EXAMPLES = 5
MEAN_COLUMN, STD_COLUMN, UNSEEN_COLUMN, MISSING_COLUMN = "_mean_shift", "_std_ratio", "_unseen_categories", "_missing"


@dataclass(frozen=True)
class ModelInput:
    """One raw column the model takes, with the train split's statistics where the manifest has them."""

    name: str
    kind: str  # "numeric" | "categorical"
    mean: float | None = None
    std: float | None = None
    categories: tuple[str, ...] | None = None
    imputed: bool = False  # a missing value is filled (data.missing_values='impute'), not an error


def model_inputs(manifest: Mapping[str, Any]) -> list[ModelInput]:
    """The raw columns a model trained on ``manifest`` takes, in order."""
    if manifest.get("source_kind", "table") != "table":
        raise DataError(f"the model was trained on {manifest.get('source_kind')} ({manifest.get('source_uri')}); "
                        "batch scoring reads tables")
    prep = manifest.get("preprocessing")
    if prep:
        return [ModelInput(c["name"], c["kind"], c.get("mean"), c.get("std"),
                           tuple(c["categories"]) if c["kind"] == "categorical" else None, c.get("fill") is not None)
                for c in prep["inputs"]]
    schema = manifest.get("schema") or {}
    categorical = set(schema.get("categorical_columns") or [])
    return [ModelInput(n, "categorical" if n in categorical else "numeric")
            for n in schema.get("feature_columns") or manifest["feature_columns"]]


def _is_numeric(arrow_type: str) -> bool:
    return arrow_type.startswith(_NUMERIC_TYPES)


def check_schema(inputs: list[ModelInput], plan: InputPlan, id_column: str | None) -> None:
    """Every file holds every input column (numbers where the model was trained on numbers) and
    the id column, if training had one; else ``DataValidationError`` naming the columns (one
    failure per column, with the files it is wrong in)."""
    missing: dict[str, list[str]] = {}
    text: dict[str, list[str]] = {}
    wanted = [m.name for m in inputs] + ([id_column] if id_column and id_column not in {m.name for m in inputs} else [])
    numeric = {m.name for m in inputs if m.kind == "numeric"}
    for f in plan.files:
        for c in wanted:
            if c not in f.columns:
                missing.setdefault(c, []).append(f.uri)
            elif c in numeric and not _is_numeric(f.columns[c]):
                text.setdefault(c, []).append(f"{f.uri} ({f.columns[c]})")
    n = len(plan.files)

    def files(found: list[str]) -> str:
        return f"{len(found)} of {n} files: {', '.join(found[:3])}{' …' if len(found) > 3 else ''}"

    failures = [{"check": "column_present", "column": c, "files": found,
                 "message": f"{'id column' if c == id_column else 'column'} {c!r} is missing ({files(found)})"}
                for c, found in missing.items()]
    failures += [{"check": "column_is_numeric", "column": c, "files": found,
                  "message": f"column {c!r} is not numbers, the model was trained on numbers ({files(found)})"}
                 for c, found in text.items()]
    if failures:
        columns = [f["column"] for f in failures]
        raise DataValidationError(f"scoring input {plan.spec} does not match the model's training schema in "
                                  f"columns {columns}: " + "; ".join(f["message"] for f in failures), failures)


@dataclass
class ColumnProfile:
    name: str
    kind: str
    count: int = 0  # non-missing values (numeric: finite ones)
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations
    missing: int = 0
    nonfinite: int = 0
    unseen: int = 0  # categorical: values outside the train split's categories
    unseen_examples: list[str] = field(default_factory=list)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "count": self.count, "missing": self.missing}
        if self.kind == "numeric":
            out.update(mean=self.mean, std=self.std, nonfinite=self.nonfinite)
        else:
            out.update(unseen=self.unseen, unseen_examples=self.unseen_examples)
        return out


@dataclass
class Profile:
    columns: dict[str, ColumnProfile]
    rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "columns": [c.to_dict() for c in self.columns.values()]}


def profile(inputs: list[ModelInput], frames: Iterable[pd.DataFrame]) -> Profile:
    """One streaming pass over ``frames`` (the input's rows, any chunking): the column profiles."""
    import numpy as np

    prof = Profile({m.name: ColumnProfile(m.name, m.kind) for m in inputs})
    known = {m.name: set(m.categories) if m.categories is not None else None for m in inputs}
    for frame in frames:
        prof.rows += len(frame)
        for m in inputs:
            col, values = prof.columns[m.name], frame[m.name]
            missing = values.isna().to_numpy()
            col.missing += int(missing.sum())
            if m.kind == "numeric":
                x = values.to_numpy(dtype=np.float64, na_value=np.nan)
                finite = x[np.isfinite(x)]
                col.nonfinite += int(len(x) - len(finite) - missing.sum())
                _merge(col, finite)
                continue
            present = values[~missing].astype(str)
            col.count += len(present)
            if known[m.name] is not None:
                unseen = present[~present.isin(known[m.name])]
                col.unseen += len(unseen)
                if len(col.unseen_examples) < _EXAMPLES and len(unseen):
                    col.unseen_examples = sorted(set(col.unseen_examples) | set(unseen.unique()[:_EXAMPLES]))[:_EXAMPLES]
    return prof


def _merge(col: ColumnProfile, values: Any) -> None:
    """Chan et al.'s parallel update of (count, mean, sum of squared deviations)."""
    n_b = len(values)  # a float64 numpy array
    if not n_b:
        return
    mean_b = float(values.mean())
    m2_b = float(((values - mean_b) ** 2).sum())
    n = col.count + n_b
    delta = mean_b - col.mean
    col.mean += delta * n_b / n
    col.m2 += m2_b + delta * delta * col.count * n_b / n
    col.count = n


def drift_frame(inputs: list[ModelInput], prof: Profile, thresholds: Mapping[str, float]) -> pd.DataFrame:
    """One row per input column; each derived column holds None where the column is fine, else
    what is wrong with it ("x: mean 7.1 vs train 0.0 ± 1.0: 7.1 train std away")."""
    import pandas as pd

    limits = {**DEFAULT_DRIFT, **thresholds}
    rows = []
    for m in inputs:
        col = prof.columns[m.name]
        row: dict[str, Any] = {"column": m.name, MEAN_COLUMN: None, STD_COLUMN: None, UNSEEN_COLUMN: None,
                               MISSING_COLUMN: None}
        bad = col.missing if not m.imputed else 0
        bad += col.nonfinite
        if bad:
            row[MISSING_COLUMN] = (f"{m.name}: {col.missing} missing and {col.nonfinite} non-finite values "
                                   f"({'the model imputes missing values, not inf' if m.imputed else 'the model was trained with none'})")
        if m.kind == "numeric" and m.mean is not None and m.std and col.count:
            shift = abs(col.mean - m.mean) / m.std
            if shift > limits["max_mean_shift"]:
                row[MEAN_COLUMN] = (f"{m.name}: mean {col.mean:.4g} vs train {m.mean:.4g} ± {m.std:.4g}: "
                                    f"{shift:.2f} train std away (at most {limits['max_mean_shift']})")
            ratio = col.std / m.std
            if ratio > limits["max_std_ratio"] or ratio < 1 / limits["max_std_ratio"]:
                row[STD_COLUMN] = (f"{m.name}: std {col.std:.4g} vs train {m.std:.4g}: ratio {ratio:.2f} "
                                   f"(within 1/{limits['max_std_ratio']}..{limits['max_std_ratio']})")
        if m.kind == "categorical" and m.categories is not None and col.count:
            share = col.unseen / col.count
            if share > limits["max_unseen_share"]:
                row[UNSEEN_COLUMN] = (f"{m.name}: {share:.1%} of values are categories the train split never had "
                                      f"(e.g. {col.unseen_examples}; at most {limits['max_unseen_share']:.1%})")
        rows.append(row)
    return pd.DataFrame(rows, columns=["column", MEAN_COLUMN, STD_COLUMN, UNSEEN_COLUMN, MISSING_COLUMN],
                        dtype=object)


def drift_suite() -> list[Any]:
    import great_expectations.expectations as gxe

    return [gxe.ExpectColumnValuesToBeNull(column=MISSING_COLUMN,
                                           description="no missing value the model cannot fill, no inf"),
            gxe.ExpectColumnValuesToBeNull(column=MEAN_COLUMN, description="each numeric mean near the train mean"),
            gxe.ExpectColumnValuesToBeNull(column=STD_COLUMN, description="each numeric spread near the train spread"),
            gxe.ExpectColumnValuesToBeNull(column=UNSEEN_COLUMN,
                                           description="categorical values mostly ones the train split had")]


def run_drift_suite(frame: pd.DataFrame) -> dict[str, Any]:
    """The GX result (JSON) of ``drift_suite`` on the drift frame."""
    from data_checks.suites import _import_gx

    gx = _import_gx()
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (context.data_sources.add_pandas("scoring").add_dataframe_asset("profile")
             .add_batch_definition_whole_dataframe("columns"))
    suite = context.suites.add(gx.ExpectationSuite(name="scoring-drift", expectations=drift_suite()))
    validation = context.validation_definitions.add(gx.ValidationDefinition(name="drift", data=batch, suite=suite))
    # COMPLETE: every bad column is named (the frame has one row per input column: small).
    return validation.run(batch_parameters={"dataframe": frame}, result_format="COMPLETE").to_json_dict()


def check_drift(inputs: list[ModelInput], prof: Profile, thresholds: Mapping[str, float],
                spec: str) -> dict[str, Any]:
    """``DataValidationError`` naming every drifted column, else the summary the output manifest
    keeps (the profile, the thresholds, whether train statistics were there to compare)."""
    frame = drift_frame(inputs, prof, thresholds)
    result = run_drift_suite(frame)
    failures = []
    for r in result["results"]:
        if r["success"]:
            continue
        column = r["expectation_config"]["kwargs"]["column"]
        described = (r.get("result") or {}).get("unexpected_list") or []
        names = [str(v).split(":", 1)[0] for v in described]
        failures.append({"expectation": r["expectation_config"]["type"], "check": column, "columns": names,
                         "description": r["expectation_config"].get("description"), "examples": described})
    has_stats = any(m.mean is not None or m.categories is not None for m in inputs)
    if failures:
        columns = sorted({c for f in failures for c in f["columns"]})
        details = "; ".join(d for f in failures for d in f["examples"])
        raise DataValidationError(f"scoring input {spec} drifted from the model's training data in columns "
                                  f"{columns}: {details}", failures)
    if not has_stats:
        log.warning("the training manifest holds no train statistics (no preprocessing record): only missing "
                    "and non-finite values were checked, not the distributions")
    return {"passed": True, "train_statistics": has_stats, "thresholds": {**DEFAULT_DRIFT, **thresholds},
            "profile": prof.to_dict()}
