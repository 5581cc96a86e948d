"""The table preprocessing record of a manifest (``manifest["preprocessing"]``), as readers use it.

``data_checks.preprocess`` fits it on the train split and writes every shard through it; the
registered model applies it to raw rows (``training/tracking/pyfunc_model.py``, its own copy of
the forward transform: that file must stay self-contained). The record::

    {"fit_on": "train", "rows": <train rows>, "standardize": bool, "missing_values": "fail"|"impute",
     "categorical_encoding": "onehot", "unknown": "<unknown>",
     "inputs": [{"name", "kind": "numeric", "mean", "std", "fill"},
                {"name", "kind": "categorical", "categories": [...], "fill"}],
     "output_columns": [...], "imputed": {split: {column: count}},
     "targets": [{"name", "mean", "std"}]}   # regression with data.standardize only

``fill`` is the train median (numeric) or most frequent value (categorical) when missing values
are imputed, else None. A categorical input becomes ``len(categories) + 1`` one-hot columns, the
last one the unknown bucket (a value the train split never had).

``targets`` (absent: the targets are trained raw) holds each regression target's train mean and
std: the network trains on ``(y - mean) / std`` (``TargetScale``), and its outputs are turned
back into the targets' units by ``TargetScale.restore`` wherever they are scored or served (the
registered model has its own copy).

Here also: the inverse, a frame of raw-equivalent rows for shard features, so the held-out test split
can be scored by a model that takes the raw table (an imputed value comes back as its fill, an
unknown category as ``unknown``: the model maps both back to the same features).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

UNKNOWN = "<unknown>"
# The file of the preprocessing record in an exported model folder.
FILE_NAME = "preprocessing.json"


def input_columns(record: dict[str, Any]) -> list[str]:
    return [c["name"] for c in record["inputs"]]


def raw_numbers(record: dict[str, Any], X: np.ndarray) -> np.ndarray:
    """Shard features with each numeric column's standardisation undone (float64; one-hot
    columns as they are): the values a report shows."""
    out = X.astype(np.float64)
    if record["standardize"]:
        j = 0
        for col in record["inputs"]:
            if col["kind"] == "numeric":
                out[:, j] = out[:, j] * col["std"] + col["mean"]
            j += 1 if col["kind"] == "numeric" else len(col["categories"]) + 1
    return out


def unknown_value(categories: list[str]) -> str:
    """A value outside ``categories`` (``UNKNOWN``, lengthened in the unlikely case it is one)."""
    value = UNKNOWN
    while value in categories:
        value += "?"
    return value


def numeric_bounds(record: dict[str, Any], low: float, high: float) -> tuple[np.ndarray, np.ndarray]:
    """Per output column, the bounds that a raw value in ``[low, high]`` has after the transform
    (one-hot columns: unbounded), so a declared ``data.feature_range`` stays a range of raw values."""
    lows, highs = [], []
    for col in record["inputs"]:
        if col["kind"] == "numeric":
            mean, std = (col["mean"], col["std"]) if record["standardize"] else (0.0, 1.0)
            lows.append((low - mean) / std)
            highs.append((high - mean) / std)
        else:
            width = len(col["categories"]) + 1
            lows += [-np.inf] * width
            highs += [np.inf] * width
    return np.array(lows), np.array(highs)


@dataclass(frozen=True)
class TargetScale:
    """The standardisation of regression targets fitted on the train split (``record["targets"]``)."""

    mean: np.ndarray  # float64 [num_targets]
    std: np.ndarray   # float64 [num_targets], never 0

    @classmethod
    def of(cls, record: dict[str, Any] | None) -> TargetScale | None:
        """The scale a preprocessing record holds, or None (targets trained raw)."""
        targets = (record or {}).get("targets")
        if not targets:
            return None
        return cls(np.array([t["mean"] for t in targets], np.float64), np.array([t["std"] for t in targets], np.float64))

    def standardize(self, y: np.ndarray) -> np.ndarray:
        """Targets in their units ``[n, num_targets]`` → what the network trains on (float32).
        Computed in float64 from the float32 targets: a pure function of the shards' bytes."""
        return ((np.asarray(y, np.float64) - self.mean) / self.std).astype(np.float32)

    def restore(self, outputs: np.ndarray) -> np.ndarray:
        """Network outputs ``[n, num_targets]`` → predictions in the targets' units (float64)."""
        return np.asarray(outputs, np.float64) * self.std + self.mean
