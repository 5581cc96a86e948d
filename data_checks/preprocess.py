"""Table preprocessing: fitted on the train split at shard time, applied to every split.

The sharder's first pass writes each row as read: numbers as float32, a categorical (text)
column as the code of its value in the reader's vocabulary of every split, a missing value as
NaN. Once every row is placed, ``fit`` learns from the **train shards only** (validation and
test rows never touch a statistic): the mean and standard deviation of each numeric column (a
constant column keeps std 1), its median, each categorical column's vocabulary (the values the
train split has, sorted) and its most frequent value. ``rewrite`` then passes every shard
through ``transform``: standardise, impute (``data.missing_values='impute'``: the median or the
most frequent value; 'fail' leaves NaN, which validation reports), one-hot with an unknown
bucket for values the train split never had. The record (``common.preprocessing``) goes into the
manifest, with the count of imputed values per split and column.

Regression targets stay raw in the shards (validation checks them in the source's units), but
with ``data.standardize`` their train mean and standard deviation go into the record too
(``targets``, ``fit_targets``): the network trains on standardised targets
(``training.feed.data``), and the registered model turns its outputs back into the targets' units.

Memory: one block of ``data.chunk_rows`` records at a time, plus (imputing only) the train
split's numeric columns, 4 bytes a value, for exact medians.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from common import record_codec
from common.preprocessing import UNKNOWN
from data_checks.errors import DataError

if TYPE_CHECKING:
    from common.config import DataConfig
    from data_checks.readers import Layout

log = logging.getLogger(__name__)

# More train values than this in a text column is an id or free text, not a category.
MAX_CATEGORIES = 1000


def needed(data: "DataConfig", layout: "Layout") -> bool:
    """Whether a table's shards need a preprocessing pass (else they keep the values as read)."""
    return data.standardize or data.missing_values == "impute" or bool(layout.categorical)


# Exact sums. The statistics must come out bit-identical whatever the order the train rows are
# summed in: one sharder reads them shard by shard, mapped sharding (``data_checks.parts``) part
# by part, and a float sum depends on its order. A float32 value is ``m * 2**e`` with an integer
# ``|m| < 2**24``; per exponent, the integer mantissas add up exactly in float64 (bincount) for
# up to 2**29 values, and the per-exponent sums then add up exactly as a Python int scaled by
# ``2**_SHIFT``. Squares (``m**2 < 2**48``) are summed as two 24-bit halves the same way. The
# result (count, sum, sum of squares as ints, and the count of non-finite values left out) merges
# by integer addition, in any order; the mean and standard deviation are rounded once, from the
# exact rationals (NaN if any value was not finite: validation names those rows).
_SHIFT = 172  # float32's smallest subnormal is 2**-149 = 2**23 * 2**-172: every exponent is >= 0
_BUCKETS = 2 * (128 + _SHIFT) + 1
_MAX_BLOCK = 1 << 29


Moments = tuple[int, int, int, int]


def exact_moments(values: np.ndarray) -> Moments:
    """``(n, sum * 2**172, sum of squares * 2**344, non-finite)`` of float32 values, exactly
    (the sums over the ``n`` finite values)."""
    out = [0, 0, 0, 0]
    for start in range(0, len(values), _MAX_BLOCK):
        x = np.asarray(values[start:start + _MAX_BLOCK], np.float32).astype(np.float64)
        finite = np.isfinite(x)
        out[3] += int((~finite).sum())
        x = x[finite]
        if not len(x):
            continue
        m, e = np.frexp(x)
        mant = (m * (1 << 24)).astype(np.int64)  # exact: a float32 has 24 significant bits
        exp = (e - 24 + _SHIFT).astype(np.int64)
        sums = np.bincount(exp, weights=mant.astype(np.float64), minlength=_BUCKETS)
        square = mant * mant
        exp2 = 2 * exp
        hi = np.bincount(exp2, weights=(square >> 24).astype(np.float64), minlength=_BUCKETS)
        lo = np.bincount(exp2, weights=(square & ((1 << 24) - 1)).astype(np.float64), minlength=_BUCKETS)
        out[0] += len(x)
        out[1] += sum(int(v) << b for b, v in enumerate(sums.tolist()) if v)
        out[2] += sum((int(h) << (b + 24)) + (int(v) << b) for b, (h, v) in enumerate(zip(hi.tolist(), lo.tolist()))
                      if h or v)
    return out[0], out[1], out[2], out[3]


def add_moments(a: Moments | list[int], b: Moments | list[int]) -> Moments:
    return int(a[0]) + int(b[0]), int(a[1]) + int(b[1]), int(a[2]) + int(b[2]), int(a[3]) + int(b[3])


def mean_std(moments: Moments | list[int]) -> tuple[float, float]:
    """The mean and (population) standard deviation, each rounded once from the exact sums."""
    n, s, q, bad = (int(v) for v in moments)
    if bad:
        return math.nan, math.nan
    if not n:
        return 0.0, 0.0
    mean = Fraction(s, n << _SHIFT)
    var = Fraction(n * q - s * s, (n * n) << (2 * _SHIFT))
    return float(mean), math.sqrt(float(var))


def fit_partial(train: Iterable[np.ndarray], layout: "Layout", codes: dict[str, dict[str, int]],
                data: "DataConfig") -> dict[str, Any]:
    """What ``fit`` needs from some train rows (features as read), in a form that merges exactly
    (``merge_partials``): rows, exact moments per numeric column, value counts per categorical
    column and (imputing) the finite values per numeric column, for exact medians."""
    impute = data.missing_values == "impute"
    counts = {name: [0] * len(values) for name, values in codes.items()}
    moments = {name: (0, 0, 0, 0) for name in layout.feature_columns if name not in codes}
    columns: dict[str, list[np.ndarray]] = {name: [] for name in moments} if impute else {}
    rows = 0
    for X in train:
        rows += len(X)
        for j, name in enumerate(layout.feature_columns):
            x = X[:, j]
            if name in codes:
                got = np.bincount(x[~np.isnan(x)].astype(np.int64), minlength=len(counts[name]))
                counts[name] = [a + int(b) for a, b in zip(counts[name], got.tolist())]
                continue
            finite = x[np.isfinite(x)]
            moments[name] = add_moments(moments[name], exact_moments(finite))
            if impute:
                columns[name].append(finite.astype(np.float32))
    values = {name: np.concatenate(parts) if parts else np.zeros(0, np.float32) for name, parts in columns.items()}
    return {"rows": rows, "moments": moments, "counts": counts, "values": values}


def merge_partials(partials: list[dict[str, Any]]) -> dict[str, Any]:
    """Partials of disjoint row sets → the partial of their union (integer sums: any order)."""
    first = partials[0]
    out = {"rows": sum(p["rows"] for p in partials),
           "moments": {k: tuple(sum(int(p["moments"][k][i]) for p in partials) for i in range(4))
                       for k in first["moments"]},
           "counts": {k: [sum(int(p["counts"][k][i]) for p in partials) for i in range(len(v))]
                      for k, v in first["counts"].items()},
           # A median depends on the multiset of values only: their order does not matter.
           "values": {k: np.concatenate([p["values"][k] for p in partials]) for k in first["values"]}}
    return out


def fit(train: Callable[[], Iterator[np.ndarray]], layout: "Layout", codes: dict[str, dict[str, int]],
        data: "DataConfig") -> dict[str, Any]:
    """The preprocessing record from the train shards' features (as read): ``train()`` yields
    them a block at a time."""
    return fit_from_partial(fit_partial(train(), layout, codes, data), layout, codes, data)


def fit_from_partial(partial: dict[str, Any], layout: "Layout", codes: dict[str, dict[str, int]],
                     data: "DataConfig") -> dict[str, Any]:
    """The preprocessing record from the (merged) partial of every train row."""
    impute = data.missing_values == "impute"
    inputs: list[dict[str, Any]] = []
    for name in layout.feature_columns:
        if name in codes:
            counts_ = partial["counts"][name]
            values = list(codes[name])
            seen = sorted(values[c] for c, n in enumerate(counts_) if n)
            if len(seen) > MAX_CATEGORIES:
                raise DataError(f"text column {name!r} has {len(seen)} distinct values in the train split (at most "
                                f"{MAX_CATEGORIES} categories, e.g. {seen[:5]}): an id or free text is no category; "
                                "name it in data.id_column or leave it out of data.feature_columns")
            most = max(seen, key=lambda v: counts_[codes[name][v]]) if seen else None  # ties: first sorted
            inputs.append({"name": name, "kind": "categorical", "categories": seen,
                           "fill": most if impute else None})
            continue
        mean, std = mean_std(partial["moments"][name])
        fill = None
        if impute:
            finite = partial["values"][name].astype(np.float64)
            fill = float(np.median(finite)) if len(finite) else 0.0
        inputs.append({"name": name, "kind": "numeric", "mean": mean, "std": std if std > 0 else 1.0, "fill": fill})
    output: list[str] = []
    for col in inputs:
        output += [col["name"]] if col["kind"] == "numeric" else \
            [f"{col['name']}={v}" for v in col["categories"]] + [f"{col['name']}={UNKNOWN}"]
    return {"fit_on": "train", "rows": partial["rows"], "standardize": data.standardize,
            "missing_values": data.missing_values, "categorical_encoding": "onehot", "unknown": UNKNOWN,
            "inputs": inputs, "output_columns": output, "imputed": {}}


def target_moments(train: Iterable[np.ndarray], count: int) -> list[Moments]:
    """Exact moments of each of ``count`` target columns over ``train``'s blocks ``[rows, count]``."""
    moments: list[Moments] = [(0, 0, 0, 0)] * count
    for Y in train:
        moments = [add_moments(moments[k], exact_moments(Y[:, k])) for k in range(count)]
    return moments


def targets_record(moments: list[Moments], names: list[str]) -> list[dict[str, Any]]:
    out = []
    for name, m in zip(names, moments):
        mean, std = mean_std(m)
        out.append({"name": name, "mean": mean, "std": std if std > 0 else 1.0})
    return out


def fit_targets(train: Callable[[], Iterator[np.ndarray]], names: list[str]) -> list[dict[str, Any]]:
    """Per target, its train mean and standard deviation (a constant target keeps std 1), from
    ``train()``'s blocks of targets ``[rows, len(names)]``: exact sums, so the same rows give the
    same bits in any order, and a resumed job trains on the same standardised targets."""
    return targets_record(target_moments(train(), len(names)), names)


def category_slots(record: dict[str, Any], codes: dict[str, dict[str, int]]) -> dict[str, np.ndarray]:
    """Per categorical input: reader code → its one-hot slot (the unknown bucket if not in train)."""
    out = {}
    for col in record["inputs"]:
        if col["kind"] == "categorical":
            index = {v: i for i, v in enumerate(col["categories"])}
            out[col["name"]] = np.array([index.get(v, len(index)) for v in codes[col["name"]]], np.int64)
    return out


def transform(record: dict[str, Any], X: np.ndarray, slots: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, int]]:
    """Features as read → features as trained on, and the count of imputed values per column."""
    n = len(X)
    out = np.empty((n, len(record["output_columns"])), np.float32)
    imputed: dict[str, int] = {}
    j = 0
    for i, col in enumerate(record["inputs"]):
        x = X[:, i]
        missing = np.isnan(x)
        fill = col["fill"] if missing.any() else None
        if fill is not None:
            imputed[col["name"]] = int(missing.sum())
        if col["kind"] == "numeric":
            v = x.astype(np.float64)
            if fill is not None:
                v[missing] = fill
            out[:, j] = (v - col["mean"]) / col["std"] if record["standardize"] else v
            j += 1
            continue
        width = len(col["categories"]) + 1
        slot = np.zeros(n, np.int64)
        slot[~missing] = slots[col["name"]][x[~missing].astype(np.int64)]
        if fill is not None:
            slot[missing] = col["categories"].index(fill)
        block = np.zeros((n, width), np.float32)
        block[np.arange(n), slot] = 1.0
        if fill is None:
            block[missing] = np.nan  # not imputed: validation reports the missing value
        out[:, j:j + width] = block
        j += width
    return out, imputed


def rewrite(paths: list[tuple[str, str]], splits: list[str], n_train: int, layout: "Layout",
            codes: dict[str, dict[str, int]], data: "DataConfig") -> dict[str, Any]:
    """Fit on the train shards (the first ``n_train`` of ``paths``), then rewrite every shard
    through the transform, in place; returns the record with the imputed counts per split.
    A regression record's payload ends with its float targets: they pass through unchanged (with
    ``data.standardize`` the record holds their train mean and std, ``targets``)."""
    nf, rows = len(layout.feature_columns), data.chunk_rows
    width = nf + len(layout.target_columns)

    def train(columns: slice) -> Callable[[], Iterator[np.ndarray]]:
        def blocks() -> Iterator[np.ndarray]:
            for idx, rec in paths[:n_train]:
                for block in record_codec.iter_blocks(idx, rec, width, rows):
                    yield block.features[:, columns]
        return blocks

    record = fit(train(slice(0, nf)), layout, codes, data)
    if layout.target_columns and data.standardize:
        record["targets"] = fit_targets(train(slice(nf, width)), list(layout.target_columns))
    slots = category_slots(record, codes)
    imputed: dict[str, dict[str, int]] = {}
    for (idx, rec), split in zip(paths, splits):
        tmp_idx, tmp_rec = idx + ".new", rec + ".new"
        with record_codec.RecordWriter(tmp_idx, tmp_rec) as writer:
            for block in record_codec.iter_blocks(idx, rec, width, rows):
                X, counts = transform(record, block.features[:, :nf], slots)
                for name, count in counts.items():
                    imputed.setdefault(split, {})[name] = imputed.get(split, {}).get(name, 0) + count
                if width > nf:
                    X = np.hstack([X, block.features[:, nf:]])
                writer.write_batch(X, block.labels, block.row_ids, block.id_hashes)
        os.replace(tmp_idx, idx)
        os.replace(tmp_rec, rec)
    record["imputed"] = imputed
    if imputed:
        log.info("imputed missing values (train medians / most frequent values): %s", imputed)
    return record
