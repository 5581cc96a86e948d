"""Split a source table into train/val/test and write per-worker RecordIO shards + a manifest.

The order of work is the commit protocol: every shard file is written locally, uploaded, and
only then is ``manifest.json`` written (conditionally: it never overwrites another writer's).
A crash at any point before that leaves no manifest, and a prefix without a manifest holds no
shards. Re-running on the same source bytes and sharding settings returns the existing manifest.

Splitting rules (deterministic for a given ``cfg.seed``):

* per class, rows are shuffled and cut into test / val / train with ``round(n * fraction)``
  rows, at least one row each for val and test, and at least one for train;
* a class with fewer than ``MIN_ROWS_TO_SPLIT`` rows cannot be cut that way and goes to train
  entirely (logged); if val or test ends up empty overall, that is a ``DataError``;
* the train rows are shuffled once more and dealt round-robin to ``cfg.num_train_shards``
  shards, so shard sizes differ by at most one.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from common import storage
from data_checks import sources
from data_checks.errors import DataError
from common.manifest import (  # re-exported for callers of the sharder
    FORMAT_VERSION,
    download_shard,
    load_manifest,
    manifest_digest,
    manifest_uri,
    to_json_bytes,
)

if TYPE_CHECKING:
    import pandas as pd

    from training.config import TrainConfig

__all__ = ["shard_dataset", "load_manifest", "manifest_digest", "download_shard", "MIN_ROWS_TO_SPLIT"]

log = logging.getLogger(__name__)

# One row each for train, val and test.
MIN_ROWS_TO_SPLIT = 3


def shard_dataset(cfg: TrainConfig, out_prefix: str, *, work_dir: str | None = None) -> dict[str, Any]:
    """Shard ``cfg.data.source_uri`` under ``out_prefix``; returns the manifest (also written)."""
    source = cfg.data.source_uri
    if not source:
        raise DataError("data.source_uri is empty: nothing to shard")
    sources.table_format(source)
    data = sources.read_bytes(source)
    source_sha = storage.sha256_bytes(data)
    params = sharding_params(cfg)

    existing = _existing_manifest(out_prefix)
    if existing is not None:
        if _same_sharding(existing, source_sha, params):
            log.info("shards under %s already match source sha256 %s: reusing them", out_prefix, source_sha[:12])
            return existing
        log.warning("shards under %s were made from other data or settings: removing them and resharding",
                    out_prefix)
        storage.delete_prefix(out_prefix)

    table = sources.parse_table(data, source)
    X, y, classes, feature_columns = _prepare(table, cfg, source)
    del table, data
    train_shards, val_rows, test_rows = _split(y, cfg)
    plan = [(f"train-{i:05d}", "train", rows) for i, rows in enumerate(train_shards)]
    plan += [("val", "val", val_rows), ("test", "test", test_rows)]

    with tempfile.TemporaryDirectory(prefix="shards-", dir=work_dir) as tmp:
        entries = [_write_shard(name, split, rows, X, y, tmp, out_prefix) for name, split, rows in plan]

    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "source_uri": source,
        "source_sha256": source_sha,
        "label_column": cfg.data.label_column,
        "feature_columns": feature_columns,
        "num_features": len(feature_columns),
        "input_shape": list(cfg.data.input_shape),
        "classes": classes,
        "num_classes": len(classes),
        "splits": {s: {"count": sum(e["count"] for e in entries if e["split"] == s)}
                   for s in ("train", "val", "test")},
        "shards": entries,
        "sharding": params,
        "config_digest": cfg.digest(),
        "seed": cfg.seed,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    # Round-trip through JSON so the returned dict equals what load_manifest() gives later.
    manifest = json.loads(to_json_bytes(manifest))
    return _commit(manifest, out_prefix, source_sha, params)


def sharding_params(cfg: TrainConfig) -> dict[str, Any]:
    """The settings that decide the shard bytes; equal params + equal source = reusable shards."""
    return {
        "format_version": FORMAT_VERSION,
        "label_column": cfg.data.label_column,
        "num_train_shards": cfg.num_train_shards,
        "val_fraction": cfg.data.val_fraction,
        "test_fraction": cfg.data.test_fraction,
        "input_shape": list(cfg.data.input_shape),
        "seed": cfg.seed,
    }


def _existing_manifest(out_prefix: str) -> dict[str, Any] | None:
    if not storage.exists(manifest_uri(out_prefix)):
        return None
    try:
        return load_manifest(out_prefix)
    except DataError as exc:
        log.warning("ignoring unreadable manifest under %s: %s", out_prefix, exc)
        return {}


def _same_sharding(manifest: dict[str, Any], source_sha: str, params: dict[str, Any]) -> bool:
    return manifest.get("source_sha256") == source_sha and manifest.get("sharding") == params


def _commit(manifest: dict[str, Any], out_prefix: str, source_sha: str, params: dict[str, Any]) -> dict[str, Any]:
    uri = manifest_uri(out_prefix)
    try:
        storage.put_bytes(uri, to_json_bytes(manifest), if_none_match=True)
    except storage.AlreadyExists:
        # A concurrent writer committed first; its shards are as good as ours if they match.
        other = load_manifest(out_prefix)
        if _same_sharding(other, source_sha, params):
            log.info("another writer committed identical shards under %s first", out_prefix)
            return other
        raise DataError(f"{uri} was committed concurrently from different data or settings") from None
    log.info("committed %d shards (%d train / %d val / %d test rows) under %s", len(manifest["shards"]),
             manifest["splits"]["train"]["count"], manifest["splits"]["val"]["count"],
             manifest["splits"]["test"]["count"], out_prefix)
    return manifest


def _prepare(table: "pd.DataFrame", cfg: TrainConfig, uri: str) -> tuple[np.ndarray, np.ndarray, list[Any], list[str]]:
    """Features as float32 (NaN/inf kept for validation to report), labels as class indices."""
    import pandas as pd

    label = cfg.data.label_column
    if label not in table.columns:
        raise DataError(f"label column {label!r} not found in {uri}; available columns: {list(table.columns)}")
    if len(table) == 0:
        raise DataError(f"source dataset has no rows (header only): {uri}")
    feature_columns = [c for c in table.columns if c != label]
    if not feature_columns:
        raise DataError(f"{uri} has no feature columns besides the label column {label!r}")
    bad = [c for c in feature_columns
           if not pd.api.types.is_numeric_dtype(table[c]) or pd.api.types.is_complex_dtype(table[c])]
    if bad:
        details = "; ".join(f"{c!r} ({table[c].dtype}, e.g. {_first_non_numeric(table[c])!r})" for c in bad[:10])
        raise DataError(f"non-numeric feature columns in {uri}: {details}"
                        f"{' …' if len(bad) > 10 else ''}; every column except the label {label!r} must be numeric")

    labels = table[label]
    missing = labels.isna()
    if missing.any():
        raise DataError(f"label column {label!r} in {uri} has {int(missing.sum())} missing values "
                        f"(first at rows {list(np.flatnonzero(missing.to_numpy())[:5])})")
    if labels.dtype == object:
        labels = labels.astype(str)
    codes, uniques = pd.factorize(labels, sort=True)
    if len(uniques) < 2:
        raise DataError(f"label column {label!r} in {uri} has a single class ({uniques[0]!r}): nothing to learn")

    n_features = len(feature_columns)
    shape = cfg.data.input_shape
    if shape and math.prod(shape) != n_features:
        raise DataError(f"data.input_shape {tuple(shape)} holds {math.prod(shape)} values but {uri} has "
                        f"{n_features} feature columns")
    X = table[feature_columns].to_numpy(dtype=np.float32)
    return X, codes.astype(np.int64), [_json_class(v) for v in uniques], [str(c) for c in feature_columns]


def _first_non_numeric(column: "pd.Series") -> Any:
    import pandas as pd

    coerced = pd.to_numeric(column, errors="coerce")
    odd = column[coerced.isna() & column.notna()]
    return odd.iloc[0] if len(odd) else column.iloc[0]


def _json_class(value: Any) -> str | int:
    """A class value as JSON keeps it: ints stay ints (also 3.0), everything else becomes a str."""
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return int(value)
    return str(value)


def _split(y: np.ndarray, cfg: TrainConfig) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Stratified, seeded split; returns (train rows per shard, val rows, test rows)."""
    rng = np.random.default_rng(cfg.seed)
    train, val, test, unsplit = [], [], [], []
    for k in range(int(y.max()) + 1):
        rows = rng.permutation(np.flatnonzero(y == k))
        n = len(rows)
        if n < MIN_ROWS_TO_SPLIT:
            unsplit.append(k)
            train.append(rows)
            continue
        n_test = max(1, _round_half_up(n * cfg.data.test_fraction))
        n_val = max(1, _round_half_up(n * cfg.data.val_fraction))
        while n - n_test - n_val < 1:  # only reachable for tiny classes with large fractions
            if n_test >= n_val:
                n_test -= 1
            else:
                n_val -= 1
        test.append(rows[:n_test])
        val.append(rows[n_test:n_test + n_val])
        train.append(rows[n_test + n_val:])
    if unsplit:
        log.warning("classes %s have fewer than %d rows: all their rows go to train", unsplit, MIN_ROWS_TO_SPLIT)
    val_rows = np.sort(np.concatenate(val)) if val else np.empty(0, np.int64)
    test_rows = np.sort(np.concatenate(test)) if test else np.empty(0, np.int64)
    if len(val_rows) == 0 or len(test_rows) == 0:
        raise DataError(f"too few rows per class for a train/val/test split: every class has fewer than "
                        f"{MIN_ROWS_TO_SPLIT} rows (source {cfg.data.source_uri})")
    train_rows = rng.permutation(np.concatenate(train))
    k_shards = cfg.num_train_shards
    if len(train_rows) < k_shards:
        raise DataError(f"{len(train_rows)} train rows cannot fill {k_shards} train shards "
                        f"(source {cfg.data.source_uri}): lower data.num_shards or cluster.num_workers")
    return [train_rows[i::k_shards] for i in range(k_shards)], val_rows, test_rows


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def _write_shard(name: str, split: str, rows: np.ndarray, X: np.ndarray, y: np.ndarray,
                 tmp: str, out_prefix: str) -> dict[str, Any]:
    """Write one ``.rec``/``.idx`` pair locally, upload it, and describe it for the manifest."""
    from common.records import RecordWriter

    idx_path, rec_path = os.path.join(tmp, f"{name}.idx"), os.path.join(tmp, f"{name}.rec")
    with RecordWriter(idx_path, rec_path) as writer:
        for r in rows:
            writer.write(X[r], int(y[r]), int(r))
    files = {}
    for kind, path in (("rec", rec_path), ("idx", idx_path)):
        fname = os.path.basename(path)
        storage.upload_file(path, storage.join(out_prefix, fname))
        files[kind] = {"name": fname, "bytes": os.path.getsize(path), "sha256": storage.sha256_file(path)}
    labels, counts = np.unique(y[rows], return_counts=True)
    return {
        "name": name,
        "split": split,
        "count": int(len(rows)),
        "label_histogram": {str(int(k)): int(c) for k, c in zip(labels, counts)},
        "files": files,
    }
