"""What one worker reads: its own train shards, and (rank 0) the validation split.

Worker ``r`` of ``W`` reads train shards ``i`` with ``i % W == r``. Every worker runs the same
number of steps per epoch (set by the largest worker's share), wrapping around its own rows,
because a ``dist_sync`` worker that stops pushing early leaves the others blocked forever.
The order of rows is a deterministic function of (seed, epoch, rank), so a resumed job can skip
to the exact position inside an epoch.

The train and validation rows are opened, not loaded (``open_split``: memory-mapped shards,
``training.feed.shard_reader``), so a worker's memory does not follow the table's size;
``fetch_split`` loads a split into memory, for callers that want whole arrays of a small one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from common import record_codec
from common.errors import DataError
from common.manifest import download_shard, record_width
from common.preprocessing import TargetScale
from training.feed.shard_reader import ShardSet

__all__ = ["fetch_split", "open_split", "shards_for_rank", "steps_per_epoch",
           "target_scale", "EpochOrder"]


def train_shards(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in manifest["shards"] if s["split"] == "train"]


def shards_for_rank(manifest: dict[str, Any], rank: int, num_workers: int) -> list[dict[str, Any]]:
    return [s for i, s in enumerate(train_shards(manifest)) if i % num_workers == rank]


def steps_per_epoch(manifest: dict[str, Any], num_workers: int, batch_size: int) -> int:
    """The same for every worker: the largest worker share, in batches."""
    shares = [sum(s["count"] for s in shards_for_rank(manifest, r, num_workers)) for r in range(num_workers)]
    if min(shares) == 0:
        raise DataError(f"{len(train_shards(manifest))} train shards cannot feed {num_workers} workers: "
                         f"a worker would get no data (shares {shares})")
    return math.ceil(max(shares) / batch_size)


def target_scale(manifest: dict[str, Any]) -> TargetScale | None:
    """The standardisation of a regression job's targets (fitted on the train split at shard
    time), or None: classification, ``data.standardize`` off, or shards written before targets
    were standardised (their jobs train on raw targets, as they did)."""
    return TargetScale.of(manifest.get("preprocessing")) if manifest.get("num_targets") else None


def fetch_split(manifest: dict[str, Any], shards_prefix: str, shards: list[dict[str, Any]],
                work_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """Download, verify (size + sha256) and load ``shards``: features ``[n, f]``, labels ``[n]``
    (regression: targets ``[n, num_targets]`` float32)."""
    xs, ys = [], []
    for shard in shards:
        idx_path, rec_path = download_shard(manifest, shards_prefix, shard["name"], work_dir)
        X, y, _ = record_codec.read_all(idx_path, rec_path, record_width(manifest))
        xs.append(X)
        ys.append(y)
    f = manifest["num_features"]
    X = np.concatenate(xs) if xs else np.empty((0, record_width(manifest)), np.float32)
    if manifest.get("num_targets"):
        return X[:, :f], X[:, f:]
    return X, np.concatenate(ys) if ys else np.empty(0, np.int32)


def open_split(manifest: dict[str, Any], shards_prefix: str, shards: list[dict[str, Any]],
               work_dir: str, *, scaled_targets: bool = True) -> ShardSet:
    """Download and verify (size + sha256) ``shards`` into ``work_dir`` and open them for random access.

    The returned set keeps working after ``work_dir`` is removed (see ``training.feed.shard_reader``).
    Its regression targets are gathered standardised (``target_scale``): what the network trains on;
    in their own units with ``scaled_targets`` off (what validation scores in).
    """
    pairs = [download_shard(manifest, shards_prefix, s["name"], work_dir) for s in shards]
    return ShardSet.open(pairs, manifest["num_features"], int(manifest.get("num_targets", 0)),
                         target_scale(manifest) if scaled_targets else None)


@dataclass
class EpochOrder:
    """Row order of one worker for one epoch, padded by wrap-around to ``steps * batch``."""

    num_rows: int
    steps: int
    batch_size: int
    seed: int
    rank: int

    def epoch_order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        perm = rng.permutation(self.num_rows)
        reps = math.ceil(self.steps * self.batch_size / self.num_rows)
        return np.tile(perm, reps)[:self.steps * self.batch_size]

    def batches(self, epoch: int, start_step: int = 0) -> Any:
        """Yields ``(step, indices)`` from ``start_step`` to the end of the epoch."""
        order = self.epoch_order(epoch)
        for step in range(start_step, self.steps):
            yield step, order[step * self.batch_size:(step + 1) * self.batch_size]
