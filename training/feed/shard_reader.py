"""Random access to a worker's train rows without holding its shards in process memory.

Why a memory map: every record of a shard the sharder writes has the same size
(``common.record_codec``), so a ``.rec`` file is an array of fixed-size structs on disk. A numpy
memmap with that struct dtype makes ``rows[idx]`` a gather from the page cache: the kernel
reads the pages a batch touches and may drop them again under memory pressure, so a worker's
footprint follows its batches, not its shards (image shards are many times a worker's RAM).
What stays in memory is the labels (4 bytes a row) and the shard offsets. Regression targets are
the last ``num_targets`` values of a record's features (``common.manifest.record_width``): they
are gathered with the features and split off, so nothing more is held.

Fallback: a shard that is valid RecordIO but not the fixed layout (dmlc splits a record whose
payload holds the magic word; another writer) is loaded into memory through
``common.record_codec.read_all``, with a warning naming the file and the reason. The sharder makes
such records only for a float whose bits equal the magic number, so this is rare.

Why it survives the download folder being removed: the worker downloads into a temporary folder
that is deleted once the shards are open. On Linux a mapping (and an open file) keeps the inode
alive until the process ends, so the pages stay readable and no shard files are left behind
when a worker exits through ``os._exit`` (preemption). The folder should be on disk, not tmpfs,
or the "page cache" is RAM that cannot be evicted (``TMPDIR``).
"""
from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from common import record_codec
from common.preprocessing import TargetScale

log = logging.getLogger(__name__)


class FeatureSource(Protocol):
    num_rows: int

    def features(self, rows: np.ndarray) -> np.ndarray:
        """``[len(rows), num_features]`` float32, a copy, rows in the order given."""
        ...


class MappedShard:
    """One fixed-layout shard, mapped read-only; ``features(rows)`` copies only those rows."""

    def __init__(self, rec_path: str, num_rows: int, num_features: int) -> None:
        self.num_rows = num_rows
        dtype = record_codec.record_dtype(num_features)
        # A zero-length file cannot be mapped; an empty shard has nothing to gather anyway.
        self._features = (np.memmap(rec_path, dtype=dtype, mode="r", shape=(num_rows,))["features"] if num_rows
                          else np.empty((0, num_features), np.float32))

    def features(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(self._features[rows])


class LoadedShard:
    """A shard held in memory (the fallback for files without the fixed-size layout)."""

    def __init__(self, X: np.ndarray) -> None:
        self.num_rows = len(X)
        self._X = X

    def features(self, rows: np.ndarray) -> np.ndarray:
        return self._X[rows]


def open_shard(idx_path: str, rec_path: str, num_features: int) -> tuple[FeatureSource, np.ndarray]:
    """The shard's feature source and its labels (int32), mapped when the layout allows it."""
    try:
        labels = record_codec.scan_fixed_layout(idx_path, rec_path, num_features)
    except record_codec.LayoutError as exc:
        log.warning("shard %s loaded into memory, it cannot be mapped: %s", rec_path, exc)
        X, y, _ = record_codec.read_all(idx_path, rec_path, num_features)
        return LoadedShard(X), y
    return MappedShard(rec_path, len(labels), num_features), labels


class ShardSet:
    """A worker's shards as one row space, in shard order (what ``np.concatenate`` of them gives).

    ``gather(idx)`` equals ``(X[idx], y[idx])`` of the concatenated arrays: ``training.feed.data.EpochOrder``
    indexes it exactly as it indexed the in-memory split.
    """

    def __init__(self, parts: list[FeatureSource], labels: list[np.ndarray], num_features: int,
                 num_targets: int = 0, target_scale: TargetScale | None = None) -> None:
        self.num_features = num_features
        self.num_targets = num_targets
        self.target_scale = target_scale  # regression: the targets are gathered standardised
        self._parts = parts
        self._starts = np.cumsum([0] + [p.num_rows for p in parts])
        self.num_rows = int(self._starts[-1])
        self.labels = np.concatenate(labels) if labels else np.empty(0, np.int32)

    @classmethod
    def open(cls, pairs: list[tuple[str, str]], num_features: int, num_targets: int = 0,
             target_scale: TargetScale | None = None) -> "ShardSet":
        """``pairs`` of verified ``(idx_path, rec_path)``, as ``common.manifest.download_shard`` returns;
        ``num_targets`` > 0: regression records (the targets follow the features), standardised
        by ``target_scale`` when given."""
        opened = [open_shard(idx, rec, num_features + num_targets) for idx, rec in pairs]
        return cls([p for p, _ in opened], [y for _, y in opened], num_features, num_targets, target_scale)

    def gather(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``idx`` (any order, repeats allowed): features ``[len(idx), f]`` float32 and labels
        (int32 classes, or regression targets ``[len(idx), num_targets]`` float32, standardised
        with ``target_scale`` when the set has one)."""
        idx = np.asarray(idx, np.int64)
        if len(self._parts) == 1:
            X = self._parts[0].features(idx)
        else:
            X = np.empty((len(idx), self.num_features + self.num_targets), np.float32)
            part_of = np.searchsorted(self._starts, idx, side="right") - 1
            for p in np.unique(part_of):
                at = part_of == p
                X[at] = self._parts[p].features(idx[at] - self._starts[p])
        if self.num_targets:
            y = X[:, self.num_features:]
            return X[:, :self.num_features], y if self.target_scale is None else self.target_scale.standardize(y)
        return X, self.labels[idx]
