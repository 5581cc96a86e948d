"""Shard a source dataset into train/val/test RecordIO shards + a manifest, streaming.

Rows flow chunk by chunk (``data.chunk_rows``) from the source (``readers`` / ``images``)
through the seeded assignment (``assign``: its docstring states the exact guarantees) into
one local ``.rec``/``.idx`` pair per shard; memory follows the chunk, not the dataset. Then:
class indices are put in their final order (declared ``data.classes`` first, else sorted), the
files are uploaded, and only then is ``manifest.json`` written, conditionally: a crash at any
point leaves no manifest, and a prefix without a manifest holds no shards.

Idempotent: the *fingerprint* is a hash of the source files' identities (S3 ETag + size, local
sha256) and of the settings that decide the shard bytes. A prefix whose manifest carries the
same fingerprint is reused as is. ``shard_content_addressed`` puts shards under
``{root}/{fingerprint[:16]}``, so a changed source or setting gets a new prefix and an
unchanged one is found again by the next run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from common import record_codec, storage
from common.manifest import FORMAT_VERSION, load_manifest, manifest_digest, manifest_uri, to_json_bytes
from data_checks import preprocess, sources
from data_checks.assign import SPLITS, TRAIN, Assigner, SplitBlock, split_summary
from data_checks.errors import DataError
from data_checks.readers import Chunk, TableReader, canonical_label

if TYPE_CHECKING:
    from common.config import TrainConfig
    from common.paths import DatasetPaths

__all__ = ["shard_dataset", "shard_content_addressed", "fingerprint"]

log = logging.getLogger(__name__)

MAX_CLASSES = 10_000
_PROGRESS_EVERY_S = 5.0
_UPLOAD_THREADS = 4


def sharding_params(cfg: TrainConfig) -> dict[str, Any]:
    """The settings that decide the shard bytes (chunk_rows does not: the output is the same)."""
    d = cfg.data
    params = {"format_version": FORMAT_VERSION, "assignment": "blocked-v1", "label_column": d.label_column,
              "id_column": d.id_column, "classes": list(d.classes), "feature_columns": list(d.feature_columns),
              "num_train_shards": cfg.num_train_shards, "val_fraction": d.val_fraction,
              "test_fraction": d.test_fraction, "input_shape": list(d.input_shape), "seed": cfg.seed,
              "preprocessing": {"version": 2, "standardize": d.standardize, "missing_values": d.missing_values}}
    if cfg.model.task == "regression":  # only then: classification fingerprints stay what they were
        params.update(task="regression", target_columns=list(cfg.target_columns))
        if d.standardize:  # the manifest holds the targets' train mean and std: shards of before lack them
            params["target_scaling"] = "standardize"
    return params


def fingerprint(plan: sources.SourcePlan, params: dict[str, Any]) -> str:
    canon = json.dumps({"source": plan.digest(), "sharding": params}, sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()


def shard_dataset(cfg: TrainConfig, out_prefix: str, *, work_dir: str | None = None) -> dict[str, Any]:
    """Shard ``cfg.data.source_uri`` under ``out_prefix``; returns the manifest (also written).

    A manifest already there with the same fingerprint is returned untouched; one from other
    data or settings is removed with its shards and the source is sharded again.
    """
    plan = sources.plan_source(cfg.data.source_uri)
    params = sharding_params(cfg)
    fp = fingerprint(plan, params)
    existing = _existing_manifest(out_prefix)
    if existing is not None:
        if existing.get("source_fingerprint") == fp:
            log.info("shards under %s already match fingerprint %s: reusing them", out_prefix, fp[:16])
            return existing
        log.warning("shards under %s were made from other data or settings: removing them and resharding",
                    out_prefix)
        storage.delete_prefix(out_prefix)
    return _shard(plan, cfg, params, fp, out_prefix, work_dir)


def shard_content_addressed(cfg: TrainConfig, root: str, *,
                            work_dir: str | None = None) -> tuple[str, dict[str, Any], bool]:
    """Shard under ``{root}/{fingerprint[:16]}``; returns ``(prefix, manifest, reused)``."""
    plan = sources.plan_source(cfg.data.source_uri)
    params = sharding_params(cfg)
    fp = fingerprint(plan, params)
    prefix = storage.join(root, fp[:16])
    existing = _existing_manifest(prefix)
    if existing is not None and existing.get("source_fingerprint") == fp:
        log.info("source and settings unchanged (fingerprint %s): reusing the shards under %s", fp[:16], prefix)
        return prefix, existing, True
    if existing is not None:  # a leftover from an older format: rebuild it
        storage.delete_prefix(prefix)
    return prefix, _shard(plan, cfg, params, fp, prefix, work_dir), False


def shard_for_run(cfg: TrainConfig, dataset: DatasetPaths) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pipeline run's shards (``shard_content_addressed`` under the dataset's folder, reused when
    the data is unchanged): ``(pointers, manifest)``, the pointers being what the run's later
    steps read (prefix, manifest URI and digest, row counts, shard names, the source fingerprint,
    and the dataset's last validated manifest, for the drift check)."""
    prefix, manifest, reused = shard_content_addressed(cfg, dataset.shards)
    return run_pointers(cfg, dataset, prefix, manifest, reused), manifest


def run_pointers(cfg: TrainConfig, dataset: DatasetPaths, prefix: str, manifest: dict[str, Any],
                 reused: bool) -> dict[str, Any]:
    """What a pipeline run's later steps read of its committed shards (``shard_for_run``)."""
    from common.manifest import read_pointer

    pointer = read_pointer(dataset.latest_validated)
    splits = manifest["splits"]
    log.info("%s %s: %s train / %s val / %s test rows in %d train shards under %s",
             "reusing the shards of" if reused else "sharded", cfg.data.source_uri, splits["train"]["count"],
             splits["val"]["count"], splits["test"]["count"], cfg.num_train_shards, prefix)
    return {"shards_prefix": prefix, "manifest_uri": manifest_uri(prefix), "manifest_digest": manifest_digest(manifest),
            "num_classes": manifest["num_classes"], "rows": {k: v["count"] for k, v in splits.items()},
            "shard_names": [s["name"] for s in manifest["shards"]], "fingerprint": manifest["source_fingerprint"],
            "reused": reused, "dataset_root": dataset.base,
            "previous_manifest_uri": pointer["manifest_uri"] if pointer else None}


def _existing_manifest(prefix: str) -> dict[str, Any] | None:
    if not storage.exists(manifest_uri(prefix)):
        return None
    try:
        return load_manifest(prefix)
    except DataError as exc:
        log.warning("ignoring unreadable manifest under %s: %s", prefix, exc)
        return {}


class _Progress:
    """Log lines with rows done and MB/s, at most every few seconds."""

    def __init__(self, total_bytes: int) -> None:
        self.total = total_bytes
        self.bytes = 0
        self.rows = 0
        self.started = self._last = time.monotonic()

    def add_bytes(self, n: int) -> None:
        self.bytes += n

    def add_rows(self, n: int) -> None:
        self.rows += n
        if time.monotonic() - self._last >= _PROGRESS_EVERY_S:
            self._last = time.monotonic()
            self.log("sharding")

    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(time.monotonic() - self.started, 1e-9)

    def log(self, what: str) -> None:
        share = f" ({100 * self.bytes / self.total:.0f}%)" if self.total else ""
        log.info("%s: %d rows, %.1f of %.1f MB read%s, %.1f MB/s", what, self.rows, self.bytes / 1e6,
                 self.total / 1e6, share, self.mb_per_s())


class _Classes:
    """Class values → ids in order of first appearance (declared classes first)."""

    def __init__(self, declared: tuple[Any, ...], on_new: Callable[[int, Any], None]) -> None:
        self.values: list[Any] = []
        self.index: dict[Any, int] = {}
        self.declared = [canonical_label(v) for v in declared]
        self._on_new = on_new
        for v in self.declared:
            self._add(v)

    def _add(self, value: Any) -> int:
        if len(self.values) >= MAX_CLASSES:
            raise DataError(f"the label column has more than {MAX_CLASSES} distinct values (e.g. "
                            f"{self.values[-3:]}): is it a class label?")
        self.index[value] = len(self.values)
        self.values.append(value)
        self._on_new(self.index[value], value)
        return self.index[value]

    def ids(self, values: list[Any]) -> np.ndarray:
        return np.array([self.index[v] if v in self.index else self._add(v) for v in values], dtype=np.int64)

    def final_order(self) -> tuple[list[Any], np.ndarray]:
        """Declared classes in their order, then the others sorted (ints before text)."""
        start = len(self.declared)
        rest = sorted(self.values[start:], key=lambda v: (isinstance(v, str), v))
        ordered = self.values[:start] + rest
        final = {v: i for i, v in enumerate(ordered)}
        return ordered, np.array([final[v] for v in self.values], dtype=np.int64)


class _Shards:
    """The local shard files being written, with counts and label histograms."""

    def __init__(self, tmp: str, names: list[str]) -> None:
        self.names = names
        self.paths = [(os.path.join(tmp, f"{n}.idx"), os.path.join(tmp, f"{n}.rec")) for n in names]
        self.writers = [record_codec.RecordWriter(idx, rec) for idx, rec in self.paths]
        self.hist: list[dict[int, int]] = [{} for _ in names]

    def write(self, dest: np.ndarray, source: np.ndarray, X: np.ndarray, classes: np.ndarray,
              row_ids: np.ndarray, ids: np.ndarray | None) -> None:
        """Write emitted row ``k`` (``X[source[k]]`` …, ``row_ids[k]``) to shard ``dest[k]``."""
        if len(dest) == 0:
            return
        order = np.argsort(dest, kind="stable")  # keeps emission order inside each shard
        bounds = np.flatnonzero(np.r_[True, dest[order][1:] != dest[order][:-1], True])
        for a, b in zip(bounds[:-1], bounds[1:]):
            rows = order[a:b]
            src = source[rows]
            d = int(dest[rows[0]])
            self.writers[d].write_batch(X[src], classes[src], row_ids[rows], None if ids is None else ids[src])
            for c, n in zip(*np.unique(classes[src], return_counts=True)):
                self.hist[d][int(c)] = self.hist[d].get(int(c), 0) + int(n)

    def close(self) -> None:
        for w in self.writers:
            w.close()


def _shard(plan: sources.SourcePlan, cfg: TrainConfig, params: dict[str, Any], fp: str, out_prefix: str,
           work_dir: str | None) -> dict[str, Any]:
    n_train = cfg.num_train_shards
    if cfg.cluster.num_workers > 1 and n_train % cfg.cluster.num_workers:
        log.warning("%d train shards for %d workers: the workers' shares will differ", n_train,
                    cfg.cluster.num_workers)
    names = [f"train-{i:05d}" for i in range(n_train)] + ["val", "test"]
    progress = _Progress(plan.total_bytes)
    block = SplitBlock.from_fractions(cfg.data.val_fraction, cfg.data.test_fraction)
    assigner = Assigner(block, n_train, cfg.seed)
    regression = cfg.model.task == "regression"
    if regression:  # float targets: every row is of one stratum, the split is a seeded random one
        if plan.kind == "images":
            raise DataError(f"model.task='regression' needs a table source with target columns, {plan.spec} "
                            "is an image folder")
        assigner.add_class(0, "regression")
    else:
        classes = _Classes(cfg.data.classes, assigner.add_class)
    with tempfile.TemporaryDirectory(prefix="shards-", dir=work_dir) as tmp:
        if plan.kind == "images":
            from data_checks.images import ImageReader

            reader: Any = ImageReader(plan, cfg.data, tmp, progress.add_bytes)
        else:
            reader = TableReader(plan, cfg.data, tmp, progress.add_bytes,
                                 targets=cfg.target_columns if regression else ())
        shards = _Shards(tmp, names)
        held: dict[int, tuple[np.ndarray, int, int]] = {}  # row id → (features, class id, id hash)
        try:
            for chunk in reader.chunks():
                cids = chunk.label_codes if regression else classes.ids(chunk.label_values)[chunk.label_codes]
                _route(chunk, cids, assigner, held, shards, n_train)
                progress.add_rows(len(chunk.row_ids))
            rest, split, shard = assigner.finish()
            if len(rest):
                X = np.stack([held[h][0] for h in rest])
                ids = np.array([held[h][2] for h in rest], dtype=np.uint64)
                shards.write(shard, np.arange(len(rest)), X, np.array([held[h][1] for h in rest]), rest, ids)
        finally:
            shards.close()
        progress.log("read")
        ordered, mapping = ([], np.zeros(1, np.int64)) if regression else classes.final_order()
        _check_splits(shards, ordered, plan.spec, n_train, regression)
        if not np.array_equal(mapping, np.arange(len(mapping))):
            for idx, rec in shards.paths:
                record_codec.rewrite_labels(idx, rec, mapping)
        lay = reader.layout
        prep = None
        if plan.kind == "table" and preprocess.needed(cfg.data, lay):
            splits = ["train"] * n_train + ["val", "test"]
            prep = preprocess.rewrite(shards.paths, splits, n_train, lay, reader.categories, cfg.data)
        entries = _upload(shards, mapping, out_prefix)
    manifest = _manifest(plan, cfg, params, fp, reader, prep, ordered, entries, block, progress)
    # The sharding settings must compare equal after a JSON round trip (reuse check).
    manifest = json.loads(to_json_bytes(manifest))
    return _commit(manifest, out_prefix)


def _manifest(plan: sources.SourcePlan, cfg: TrainConfig, params: dict[str, Any], fp: str, reader: Any,
              prep: dict[str, Any] | None, ordered: list[Any], entries: list[dict[str, Any]], block: SplitBlock,
              progress: _Progress) -> dict[str, Any]:
    """The manifest of the shards ``_shard`` wrote (before its JSON round trip)."""
    lay = reader.layout
    regression = cfg.model.task == "regression"
    features = prep["output_columns"] if prep else lay.feature_columns
    input_shape = list(cfg.data.input_shape) or list(getattr(reader, "shape", ()) or ())
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "source_uri": plan.spec,
        "source_kind": plan.kind,
        "source_format": plan.format,
        "source_fingerprint": fp,
        "source_sha256": _source_sha(reader.files_read, plan),
        "source": {"files": reader.files_read if plan.kind == "table" else reader.files_read[:1],
                   "num_files": len(plan.files), "bytes": plan.total_bytes, "listing_sha256": plan.digest()},
        "schema": lay.schema(),
        "label_column": cfg.data.label_column,
        "id_column": getattr(reader, "id_column", "") or cfg.data.id_column or None,
        "feature_columns": features,
        "num_features": len(features),
        "input_shape": input_shape,
        "feature_scaling": "pixel / 255" if plan.kind == "images" else None,
        # Fitted on the train split, applied to every split and by the registered model.
        "preprocessing": prep,
        "classes": ordered,
        "num_classes": len(ordered),
        "declared_classes": [canonical_label(v) for v in cfg.data.classes] or None,
        **(_regression_fields(cfg) if regression else {}),
        "splits": _split_totals(entries),
        "shards": entries,
        "sharding": {**params, "split_rule": split_summary(block)},
        "stats": {"rows": reader.rows, "seconds": round(time.monotonic() - progress.started, 3),
                  "source_mb_per_s": round(progress.mb_per_s(), 2), "chunk_rows": cfg.data.chunk_rows},
        "config_digest": cfg.digest(),
        "seed": cfg.seed,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    return manifest


def assign_chunk(chunk: Chunk, cids: np.ndarray, assigner: Assigner,
                 held: dict[int, tuple[np.ndarray, int, int]]) -> tuple[np.ndarray, ...]:
    """Assign one chunk and keep the rows it holds back in ``held`` (row number → payload, class
    id, id hash): ``(emitted, split, shard, local, outside, payload, ids)``, ``local`` being each
    emitted row's index in the chunk, except at ``outside``: rows released from earlier chunks."""
    emitted, split, shard, newly_held = assigner.assign(cids, chunk.row_ids)
    base, n = (int(chunk.row_ids[0]), len(chunk.row_ids)) if len(chunk.row_ids) else (0, 0)
    ids = chunk.id_hashes if chunk.id_hashes is not None else np.zeros(n, np.uint64)
    payload = chunk.payload()
    for h in newly_held:
        held[h] = (payload[h - base].copy(), int(cids[h - base]), int(ids[h - base]))
    local = emitted - base
    return emitted, split, shard, local, np.flatnonzero((local < 0) | (local >= n)), payload, ids


def _route(chunk: Chunk, cids: np.ndarray, assigner: Assigner, held: dict[int, tuple[np.ndarray, int, int]],
           shards: _Shards, n_train: int) -> None:
    """Assign one chunk and write what it emits; keep what it holds back."""
    emitted, split, shard, local, outside, payload, ids = assign_chunk(chunk, cids, assigner, held)
    n = len(chunk.row_ids)
    if len(outside):  # rare (at most 2 per class): gather them into a small extension of the chunk
        extra = [held.pop(int(emitted[i])) for i in outside]
        features = np.concatenate([payload, np.stack([e[0] for e in extra])])
        cids = np.concatenate([cids, [e[1] for e in extra]])
        ids = np.concatenate([ids, np.array([e[2] for e in extra], np.uint64)])
        local[outside] = n + np.arange(len(outside))
    else:
        features = payload
    dest = np.where(split == TRAIN, shard, n_train - 1 + split)  # val → n_train, test → n_train + 1
    shards.write(dest, local, features, cids, emitted, ids if chunk.id_hashes is not None else None)


def _check_splits(shards: _Shards, classes: list[Any], spec: str, n_train: int, regression: bool) -> None:
    _check_counts([w.count for w in shards.writers], classes, spec, n_train, regression)


def _check_counts(counts: list[int], classes: list[Any], spec: str, n_train: int, regression: bool) -> None:
    """Enough classes, and rows in every shard (``counts``: train shards, then val and test)."""
    if not regression and len(classes) < 2:
        raise DataError(f"label column in {spec} has a single class ({classes[0]!r}): nothing to learn"
                        if classes else f"{spec} has no labelled rows")
    if counts[-1] == 0 or counts[-2] == 0:
        raise DataError(f"too few rows for a train/val/test split: fewer than 3 rows (source {spec})" if regression
                        else f"too few rows per class for a train/val/test split: every class has fewer than 3 rows "
                             f"(source {spec})")
    if min(counts[:n_train]) == 0:
        raise DataError(f"{sum(counts[:n_train])} train rows cannot fill {n_train} train shards "
                        f"(source {spec}): lower data.num_shards or cluster.num_workers")


def _upload(shards: _Shards, mapping: np.ndarray, out_prefix: str) -> list[dict[str, Any]]:
    """Upload every shard file (in parallel) and describe it for the manifest."""
    def one(path: str) -> dict[str, Any]:
        name = os.path.basename(path)
        storage.upload_file(path, storage.join(out_prefix, name))
        return {"name": name, "bytes": os.path.getsize(path), "sha256": storage.sha256_file(path)}

    with ThreadPoolExecutor(_UPLOAD_THREADS, thread_name_prefix="shard-upload") as pool:
        described = list(pool.map(one, [p for pair in shards.paths for p in (pair[1], pair[0])]))
    entries = []
    for i, name in enumerate(shards.names):
        split = "train" if name.startswith("train") else name
        hist = {int(mapping[c]): n for c, n in shards.hist[i].items()}
        entries.append({"name": name, "split": split, "count": shards.writers[i].count,
                        "label_histogram": {str(k): hist[k] for k in sorted(hist)},
                        "files": {"rec": described[2 * i], "idx": described[2 * i + 1]}})
    return entries


def _split_totals(entries: list[dict[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = {}
    for split in SPLITS:
        hist: dict[str, int] = {}
        for e in entries:
            if e["split"] == split:
                for k, n in e["label_histogram"].items():
                    hist[k] = hist.get(k, 0) + n
        totals[split] = {"count": sum(e["count"] for e in entries if e["split"] == split),
                         "label_histogram": {k: hist[k] for k in sorted(hist, key=int)}}
    return totals


def _regression_fields(cfg: TrainConfig) -> dict[str, Any]:
    """What a regression manifest adds: its targets (each record's values after the features)."""
    return {"task": "regression", "target_columns": list(cfg.target_columns),
            "num_targets": len(cfg.target_columns),
            "declared_target_range": list(cfg.data.target_range) or None}


def _source_sha(files: list[dict[str, Any]], plan: sources.SourcePlan) -> str:
    """The single source file's sha256; for several files (or images), a hash of the listing."""
    if plan.kind == "table" and len(files) == 1 and files[0]["sha256"]:
        return files[0]["sha256"]
    return hashlib.sha256(json.dumps(files if plan.kind == "table" else plan.identity(),
                                     sort_keys=True).encode()).hexdigest()


def _commit(manifest: dict[str, Any], out_prefix: str) -> dict[str, Any]:
    uri = manifest_uri(out_prefix)
    try:
        storage.put_bytes(uri, to_json_bytes(manifest), if_none_match=True)
    except storage.AlreadyExists:
        # A concurrent writer committed first; its shards are as good as ours if they match.
        other = load_manifest(out_prefix)
        if other.get("source_fingerprint") == manifest["source_fingerprint"]:
            log.info("another writer committed identical shards under %s first", out_prefix)
            return other
        raise DataError(f"{uri} was committed concurrently from different data or settings") from None
    splits = manifest["splits"]
    log.info("committed %d shards (%d train / %d val / %d test rows) under %s", len(manifest["shards"]),
             splits["train"]["count"], splits["val"]["count"], splits["test"]["count"], out_prefix)
    return manifest
