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
import os
from collections.abc import Callable, Iterator
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


def _merge(acc: tuple[int, float, float], values: np.ndarray) -> tuple[int, float, float]:
    """Chan et al.'s parallel update of (count, mean, sum of squared deviations)."""
    n_b = len(values)
    if n_b == 0:
        return acc
    mean_b = float(values.mean())
    m2_b = float(((values - mean_b) ** 2).sum())
    n_a, mean_a, m2_a = acc
    n = n_a + n_b
    delta = mean_b - mean_a
    return n, mean_a + delta * n_b / n, m2_a + m2_b + delta * delta * n_a * n_b / n


def fit(train: Callable[[], Iterator[np.ndarray]], layout: "Layout", codes: dict[str, dict[str, int]],
        data: "DataConfig") -> dict[str, Any]:
    """The preprocessing record from the train shards' features (as read): ``train()`` yields
    them a block at a time, once per pass."""
    impute = data.missing_values == "impute"
    numeric = [j for j, name in enumerate(layout.feature_columns) if name not in codes]
    counts = {name: np.zeros(len(values), np.int64) for name, values in codes.items()}
    moments = {j: (0, 0.0, 0.0) for j in numeric}
    columns: dict[int, list[np.ndarray]] = {j: [] for j in numeric} if impute else {}
    rows = 0
    for X in train():
        rows += len(X)
        for j, name in enumerate(layout.feature_columns):
            x = X[:, j]
            if name in codes:
                counts[name] += np.bincount(x[~np.isnan(x)].astype(np.int64), minlength=len(counts[name]))
                continue
            finite = x[np.isfinite(x)]
            moments[j] = _merge(moments[j], finite.astype(np.float64))
            if impute:
                columns[j].append(finite)
    inputs: list[dict[str, Any]] = []
    for j, name in enumerate(layout.feature_columns):
        if name in codes:
            counts_ = counts[name]
            values = list(codes[name])
            seen = sorted((values[c] for c in np.flatnonzero(counts_)))
            if len(seen) > MAX_CATEGORIES:
                raise DataError(f"text column {name!r} has {len(seen)} distinct values in the train split (at most "
                                f"{MAX_CATEGORIES} categories, e.g. {seen[:5]}): an id or free text is no category; "
                                "name it in data.id_column or leave it out of data.feature_columns")
            most = max(seen, key=lambda v: counts_[codes[name][v]]) if seen else None  # ties: first sorted
            inputs.append({"name": name, "kind": "categorical", "categories": seen,
                           "fill": most if impute else None})
            continue
        n, mean, m2 = moments[j]
        std = float(np.sqrt(m2 / n)) if n else 0.0
        fill = None
        if impute:
            finite = np.concatenate(columns.pop(j)).astype(np.float64)
            fill = float(np.median(finite)) if len(finite) else 0.0
        inputs.append({"name": name, "kind": "numeric", "mean": mean, "std": std if std > 0 else 1.0, "fill": fill})
    output: list[str] = []
    for col in inputs:
        output += [col["name"]] if col["kind"] == "numeric" else \
            [f"{col['name']}={v}" for v in col["categories"]] + [f"{col['name']}={UNKNOWN}"]
    return {"fit_on": "train", "rows": rows, "standardize": data.standardize,
            "missing_values": data.missing_values, "categorical_encoding": "onehot", "unknown": UNKNOWN,
            "inputs": inputs, "output_columns": output, "imputed": {}}


def fit_targets(train: Callable[[], Iterator[np.ndarray]], names: list[str]) -> list[dict[str, Any]]:
    """Per target, its train mean and standard deviation (a constant target keeps std 1), from
    ``train()``'s blocks of targets ``[rows, len(names)]`` in shard order: the same shards give the
    same bits, so a resumed job trains on the same standardised targets."""
    moments = [(0, 0.0, 0.0)] * len(names)
    for Y in train():
        moments = [_merge(moments[k], Y[:, k].astype(np.float64)) for k in range(len(names))]
    out = []
    for name, (n, mean, m2) in zip(names, moments):
        std = float(np.sqrt(m2 / n)) if n else 0.0
        out.append({"name": name, "mean": mean, "std": std if std > 0 else 1.0})
    return out


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
