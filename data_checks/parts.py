"""Sharding spread over parts of a source (mapped Airflow tasks): plan → count → shard → merge.

The result is byte for byte the one ``shard.shard_content_addressed`` writes in one pass (the
shards and the manifest, but for its timings and date), whatever the number of parts
(``tests/unit/test_mapped_shard.py``). What the one-pass sharder learns from the rows before a
given row, a part learns from a cheap counting pass over every part first:

- **plan** (``plan``): list the source, fingerprint it, reuse a committed manifest of the same
  fingerprint (nothing else runs then), read the first file's layout (a wrong column fails here),
  and cut the source into parts: groups of whole files of a multi-file source, or byte ranges of
  one plain CSV file (a row belongs to the range its line starts in; the file must have no quoted
  newlines, as a line is taken to be a row). A single Parquet or gzip file, and an image folder,
  are one part. The plan goes to ``{prefix}/_parts/{token}/plan.json``.
- **count** (``count``, one task per part): the part's rows, its class values with their counts
  and the row numbers of each class's first two rows, and its categorical columns' values, in
  order of appearance. Only the label and text columns are converted.
- **shard** (``shard_part``, one task per part): from every part's counts, the state of the
  seeded assignment (``assign``) where this part starts: its first row's number, each class's
  rows seen before it, the rows still held back (a class's first two rows wait for its third, in
  whichever part that is) and the train rows dealt before it (``Assigner.train_rows`` counts them
  from the counts alone). The part assigns and writes its rows into one piece per shard, with
  final class ids and the whole source's category codes. A row held back from an earlier part is
  not here: its place is noted (an *insert*) and its owner part writes it aside (*carried*), for
  the merge to put in. The part also sums what preprocessing's fit needs over the train rows it
  owns, exactly (``preprocess.fit_partial``: integer sums, so any split of the rows gives the same
  bits; the medians' values are kept as they are, a median depending only on the multiset).
- **merge** (``merge``): the preprocessing record from the merged sums; each shard assembled
  from its pieces in part order, the inserts put back, transformed, followed by the rows of
  classes of fewer than 3 rows (all train, dealt last as in one pass); uploaded; then the manifest,
  committed last and conditionally as in one pass (no manifest before every shard is uploaded); then
  the parts' folder is removed.

Intermediate files live in the store under the shards' prefix (a mapped task may run on another
worker: nothing is shared on disk) and are removed after the merge; a prefix without a manifest
holds no shards, as before. ``shard_in_parts`` runs the four steps in one process.
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from common import record_codec, storage
from common.manifest import load_manifest, to_json_bytes
from data_checks import filesystems, preprocess, sources
from data_checks.assign import TRAIN, Assigner, SplitBlock
from data_checks.errors import DataError
from data_checks.readers import Layout, Part, TableReader, canonical_label
from data_checks.shard import (MAX_CLASSES, _check_counts, _commit, _existing_manifest, _manifest, _Progress,
                               assign_chunk, fingerprint, sharding_params)

if TYPE_CHECKING:
    from common.config import TrainConfig

__all__ = ["auto_parts", "plan", "count", "shard_part", "merge", "shard_in_parts"]

log = logging.getLogger(__name__)

PARTS_DIR = "_parts"
# Auto: a part per this many source bytes, at most MAX_AUTO_PARTS (and one per file at most).
PART_BYTES = 256 << 20
MAX_AUTO_PARTS = 8


def auto_parts(plan_: sources.SourcePlan) -> int:
    """The default number of parts: one per ``PART_BYTES`` of source, at least 1, at most
    ``MAX_AUTO_PARTS`` (and at most one per file of a multi-file source)."""
    n = max(1, min(MAX_AUTO_PARTS, -(-plan_.total_bytes // PART_BYTES)))
    return min(n, len(plan_.files)) if len(plan_.files) > 1 else n


def _splittable(plan_: sources.SourcePlan) -> bool:
    """One plain CSV file on a store with ranged reads: cut by byte ranges."""
    return (plan_.kind == "table" and plan_.format == "csv" and len(plan_.files) == 1
            and not filesystems.is_http(plan_.files[0].fs))


def _cut(plan_: sources.SourcePlan, n: int) -> list[dict[str, Any]]:
    """The parts: contiguous groups of files balanced by bytes, or byte ranges of one CSV file."""
    files = plan_.files
    if _splittable(plan_):
        size = files[0].bytes
        bounds = [k * size // n for k in range(n + 1)]
        return [{"files": [0], "span": [bounds[k], bounds[k + 1]]} for k in range(n)]
    if len(files) == 1 or plan_.kind != "table":
        return [{"files": list(range(len(files))), "span": None}]
    n = min(n, len(files))
    cum = np.cumsum([f.bytes for f in files])
    cuts = [0]
    for k in range(1, n):
        at = int(np.searchsorted(cum, k * cum[-1] / n, side="left")) + 1
        cuts.append(min(max(at, cuts[-1] + 1), len(files) - (n - k)))
    cuts.append(len(files))
    return [{"files": list(range(a, b)), "span": None} for a, b in zip(cuts[:-1], cuts[1:])]


def plan(cfg: TrainConfig, root: str, parts: int = 0, token: str = "") -> dict[str, Any]:
    """Plan the sharding under ``{root}/{fingerprint[:16]}``: ``{"prefix", "fingerprint", "reused",
    "plan_uri", "parts"}``, ``parts`` being the part indices (empty when the shards are reused, or
    for an image folder, which the merge shards in one pass). ``parts`` 0: ``auto_parts``."""
    splan = sources.plan_source(cfg.data.source_uri)
    params = sharding_params(cfg)
    fp = fingerprint(splan, params)
    prefix = storage.join(root, fp[:16])
    out: dict[str, Any] = {"prefix": prefix, "fingerprint": fp, "reused": False, "plan_uri": None, "parts": []}
    existing = _existing_manifest(prefix)
    if existing is not None and existing.get("source_fingerprint") == fp:
        log.info("source and settings unchanged (fingerprint %s): reusing the shards under %s", fp[:16], prefix)
        return {**out, "reused": True}
    if existing is not None:  # a leftover from an older format: rebuild it
        storage.delete_prefix(prefix)
    if splan.kind == "images":
        if parts > 1:
            log.warning("an image folder is sharded in one part (asked for %d): its rows are small files, "
                        "read by the merge task in one pass", parts)
        if cfg.model.task == "regression":
            raise DataError(f"model.task='regression' needs a table source with target columns, {splan.spec} "
                            "is an image folder")
        return out
    regression = cfg.model.task == "regression"
    layout = TableReader(splan, cfg.data, "", targets=cfg.target_columns if regression else ()).probe_layout()
    n = parts or auto_parts(splan)
    cut = _cut(splan, n)
    work = storage.join(prefix, PARTS_DIR, token or uuid.uuid4().hex[:12])
    doc = {"fingerprint": fp, "prefix": prefix, "work": work, "spec": splan.spec, "kind": splan.kind,
           "format": splan.format, "files": [{**f.identity(), "path": f.path} for f in splan.files],
           "layout": dataclasses.asdict(layout), "parts": cut}
    plan_uri = storage.join(work, "plan.json")
    storage.put_bytes(plan_uri, json.dumps(doc, sort_keys=True).encode())
    log.info("sharding %s (%.1f MB) in %d part(s)%s", splan.spec, splan.total_bytes / 1e6, len(cut),
             f" (asked for {n})" if len(cut) != n else "")
    return {**out, "plan_uri": plan_uri, "parts": list(range(len(cut)))}


# -- reading the plan and the parts' outputs ------------------------------------------------------

def _load(uri: str) -> dict[str, Any]:
    return json.loads(storage.get_bytes(uri))


def _source(doc: dict[str, Any], files: list[int] | None = None) -> sources.SourcePlan:
    """The source plan of the plan document (or of some of its files), without listing it again."""
    fs, _ = filesystems.resolve(doc["spec"])
    chosen = [doc["files"][i] for i in (files if files is not None else range(len(doc["files"])))]
    return sources.SourcePlan(doc["spec"], doc["kind"], doc["format"], tuple(
        sources.SourceFile(f["uri"], f["bytes"], etag=f["etag"], sha256=f["sha256"], fs=fs, path=f["path"])
        for f in chosen))


def _part_reader(cfg: TrainConfig, doc: dict[str, Any], k: int, work_dir: str, on_bytes: Any = None,
                 **part: Any) -> TableReader:
    spec = doc["parts"][k]
    regression = cfg.model.task == "regression"
    return TableReader(_source(doc, spec["files"]), cfg.data, work_dir, on_bytes,
                       targets=cfg.target_columns if regression else (),
                       part=Part(Layout(**doc["layout"]), span=tuple(spec["span"]) if spec["span"] else None, **part))


def _uri(doc: dict[str, Any], name: str) -> str:
    return storage.join(doc["work"], name)


def _put_npz(uri: str, **arrays: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    storage.put_bytes(uri, buf.getvalue())


def _get_npz(uri: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(storage.get_bytes(uri)), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


# -- count ----------------------------------------------------------------------------------------

def count(cfg: TrainConfig, plan_uri: str, k: int) -> str:
    """Part ``k``'s counts (rows, classes with counts and first two row numbers, categories'
    values in order of appearance) → ``count-{k}.json`` beside the plan; returns its URI."""
    doc = _load(plan_uri)
    started = time.monotonic()
    classes: dict[Any, list[Any]] = {}  # value → [rows, [row numbers of its first two rows]]
    with tempfile.TemporaryDirectory(prefix="count-") as tmp:
        reader = _part_reader(cfg, doc, k, tmp, counting=True)
        for chunk in reader.chunks():
            values = chunk.label_values
            codes = chunk.label_codes
            uniq, first, n = np.unique(codes, return_index=True, return_counts=True)
            for i in np.argsort(first, kind="stable"):  # in order of first appearance
                entry = classes.setdefault(values[int(uniq[i])], [0, []])
                if len(entry[1]) < 2:
                    at = np.flatnonzero(codes == uniq[i])[:2 - len(entry[1])]
                    entry[1] += [int(r) for r in chunk.row_ids[at]]
                entry[0] += int(n[i])
    out = {"rows": reader.rows, "classes": [[v, c, f] for v, (c, f) in classes.items()],
           "categories": {c: list(v) for c, v in reader.categories.items()}}
    uri = _uri(doc, f"count-{k:05d}.json")
    storage.put_bytes(uri, json.dumps(out).encode())
    log.info("part %d: counted %d rows of %d classes in %.1f s", k, reader.rows, len(classes),
             time.monotonic() - started)
    return uri


@dataclasses.dataclass
class _State:
    """Where each part starts in the one-pass order, from every part's counts."""

    rows: int
    offsets: list[int]  # first row number of each part
    values: list[Any]  # class values in their final order (their ids)
    totals: dict[int, int]  # class id → rows
    prefix: list[dict[int, int]]  # per part: class id → rows before it
    held: list[dict[int, list[int]]]  # per part: class id → rows held back when it starts
    trained: list[int]  # per part (and one past the last): train rows dealt before it
    codes: dict[str, dict[str, int]]  # categorical column → value → code (one-pass order)
    counts: list[dict[str, Any]]

    def ids(self, values: list[Any]) -> np.ndarray:
        index = {v: i for i, v in enumerate(self.values)}
        try:
            return np.array([index[v] for v in values], np.int64)
        except KeyError as exc:
            raise DataError(f"class {exc.args[0]!r} was not there when the parts were counted: did the "
                            "source change while it was sharded?") from None


def _assigner(cfg: TrainConfig, values: list[Any]) -> Assigner:
    block = SplitBlock.from_fractions(cfg.data.val_fraction, cfg.data.test_fraction)
    assigner = Assigner(block, cfg.num_train_shards, cfg.seed)
    for i, v in enumerate(values):
        assigner.add_class(i, v)
    return assigner


def _state(cfg: TrainConfig, doc: dict[str, Any]) -> _State:
    counts = [_load(_uri(doc, f"count-{k:05d}.json")) for k in range(len(doc["parts"]))]
    offsets = list(np.cumsum([0] + [c["rows"] for c in counts[:-1]]).tolist())
    if cfg.model.task == "regression":  # one stratum (shard._shard does the same)
        values: list[Any] = ["regression"]
        local = [{v: 0 for v, _, _ in c["classes"]} for c in counts]
    else:
        declared = [canonical_label(v) for v in cfg.data.classes]
        seen = list(dict.fromkeys(v for c in counts for v, _, _ in c["classes"] if v not in declared))
        if len(declared) + len(seen) > MAX_CLASSES:
            raise DataError(f"the label column has more than {MAX_CLASSES} distinct values (e.g. "
                            f"{seen[:3]}): is it a class label?")
        # _Classes.final_order: the declared classes in their order, then the others sorted.
        values = declared + sorted(seen, key=lambda v: (isinstance(v, str), v))
        ids = {v: i for i, v in enumerate(values)}
        local = [{v: ids[v] for v, _, _ in c["classes"]} for c in counts]
    assigner = _assigner(cfg, values)
    seen_rows: dict[int, int] = {}
    firsts: dict[int, list[int]] = {}
    prefix, held, trained = [], [], [0]
    for k, c in enumerate(counts):
        prefix.append(dict(seen_rows))
        held.append({cid: firsts[cid][:p] for cid, p in seen_rows.items() if p < 3})
        dealt = 0
        for v, n, first in c["classes"]:
            cid = local[k][v]
            p = seen_rows.get(cid, 0)
            firsts.setdefault(cid, [])
            firsts[cid] += [offsets[k] + r for r in first][:max(0, 2 - len(firsts[cid]))]
            # Rows emitted while this part is read: a class's rows from its third on, and its
            # first two with its third (numbers within the class [E(p), E(p + n)), E(x) = x if x >= 3 else 0).
            dealt += assigner.train_rows(cid, p if p >= 3 else 0, p + n if p + n >= 3 else 0)
            seen_rows[cid] = p + n
        trained.append(trained[-1] + dealt)
    codes: dict[str, dict[str, int]] = {}
    for name in doc["layout"]["categorical"]:
        codes[name] = {}
        for c in counts:
            for v in c["categories"][name]:
                codes[name].setdefault(v, len(codes[name]))
    return _State(sum(c["rows"] for c in counts), offsets, values, seen_rows, prefix, held, trained, codes, counts)


# -- shard ----------------------------------------------------------------------------------------

def _names(cfg: TrainConfig) -> list[str]:
    return [f"train-{i:05d}" for i in range(cfg.num_train_shards)] + ["val", "test"]


class _Pieces:
    """One part's pieces of every shard, with the places of the rows other parts write."""

    def __init__(self, tmp: str, names: list[str]) -> None:
        self.paths = [(os.path.join(tmp, f"{n}.idx"), os.path.join(tmp, f"{n}.rec")) for n in names]
        self.writers = [record_codec.RecordWriter(idx, rec) for idx, rec in self.paths]
        self.emitted = [0] * len(names)  # rows placed in each piece, the inserts included
        self.inserts: list[list[list[int]]] = [[] for _ in names]  # [place, row number]

    def write(self, dest: np.ndarray, source: np.ndarray, X: np.ndarray, classes: np.ndarray, row_ids: np.ndarray,
              ids: np.ndarray, elsewhere: np.ndarray) -> None:
        """Emitted row ``k`` goes to piece ``dest[k]`` (``X[source[k]]`` …) or, if ``elsewhere[k]``,
        is an insert there (its payload is another part's)."""
        order = np.argsort(dest, kind="stable")  # keeps emission order inside each piece
        bounds = np.flatnonzero(np.r_[True, dest[order][1:] != dest[order][:-1], True]) if len(dest) else [0]
        for a, b in zip(bounds[:-1], bounds[1:]):
            rows = order[a:b]
            d = int(dest[rows[0]])
            away = elsewhere[rows]
            for r in np.flatnonzero(away):
                self.inserts[d].append([self.emitted[d] + int(r), int(row_ids[rows[r]])])
            here = rows[~away]
            src = source[here]
            self.writers[d].write_batch(X[src], classes[src], row_ids[here], ids[src])
            self.emitted[d] += len(rows)

    def close(self) -> None:
        for w in self.writers:
            w.close()


def shard_part(cfg: TrainConfig, plan_uri: str, k: int) -> str:
    """Shard part ``k`` into its pieces (beside the plan, ``part-{k}/``); returns the URI of its
    summary (``part-{k}.json``: pieces, inserts, the fit's exact partial sums)."""
    doc = _load(plan_uri)
    state = _state(cfg, doc)
    started = time.monotonic()
    regression = cfg.model.task == "regression"
    names = _names(cfg)
    n_train = cfg.num_train_shards
    assigner = _assigner(cfg, state.values)
    assigner.resume(state.prefix[k], state.held[k], state.trained[k])
    layout = Layout(**doc["layout"])
    nf, width = len(layout.feature_columns), len(layout.feature_columns) + len(layout.target_columns)
    with tempfile.TemporaryDirectory(prefix="part-") as tmp:
        reader = _part_reader(cfg, doc, k, tmp, first_row=state.offsets[k], categories=state.codes)
        pieces = _Pieces(tmp, names)
        own: dict[int, tuple[np.ndarray, int, int]] = {}  # row number → (payload, class id, id hash)
        try:
            for chunk in reader.chunks():
                cids = chunk.label_codes if regression else state.ids(chunk.label_values)[chunk.label_codes]
                _route(chunk, cids, assigner, own, pieces, n_train, width)
        finally:
            pieces.close()
        if assigner.trained != state.trained[k + 1]:
            raise RuntimeError(f"part {k} dealt {assigner.trained - state.trained[k]} train rows, its counts said "
                               f"{state.trained[k + 1] - state.trained[k]}")
        # This part's rows still held back: their place is in a later part, or (classes of under
        # 3 rows) at the end; they are written aside, with the split they will get.
        carried = [(h, w, c) for c, hs in assigner.held().items() for w, h in enumerate(hs) if h in own]
        handles = np.array([h for h, _, _ in carried], np.int64)
        payload = np.stack([own[h][0] for h, _, _ in carried]) if carried else np.zeros((0, width), np.float32)
        train = np.array([state.totals[c] < 3 or assigner.split_at(c, w) == TRAIN for _, w, c in carried], bool)
        _put_npz(_uri(doc, f"carried-{k:05d}.npz"), handles=handles, payload=payload,
                 classes=np.array([own[h][1] for h, _, _ in carried], np.int64),
                 ids=np.array([own[h][2] for h, _, _ in carried], np.uint64))
        summary: dict[str, Any] = {"rows": reader.rows - state.offsets[k], "files_read": reader.files_read,
                                   "pieces": {}, "partial": None, "targets": None}
        for name, (idx, rec), w, emitted, inserts in zip(names, pieces.paths, pieces.writers, pieces.emitted,
                                                          pieces.inserts):
            for path in (idx, rec):
                storage.upload_file(path, _uri(doc, f"part-{k:05d}/{os.path.basename(path)}"))
            summary["pieces"][name] = {"written": w.count, "emitted": emitted, "inserts": inserts}
        if preprocess.needed(cfg.data, layout):
            def train_blocks(columns: slice) -> Iterator[np.ndarray]:
                for idx, rec in pieces.paths[:n_train]:
                    for block in record_codec.iter_blocks(idx, rec, width, cfg.data.chunk_rows):
                        yield block.features[:, columns]
                yield payload[train][:, columns]

            partial = preprocess.fit_partial(train_blocks(slice(0, nf)), layout, state.codes, cfg.data)
            _put_npz(_uri(doc, f"values-{k:05d}.npz"), **partial.pop("values"))
            summary["partial"] = partial
            if layout.target_columns and cfg.data.standardize:
                summary["targets"] = preprocess.target_moments(train_blocks(slice(nf, width)),
                                                               len(layout.target_columns))
    uri = _uri(doc, f"part-{k:05d}.json")
    storage.put_bytes(uri, json.dumps(summary).encode())
    log.info("part %d: sharded %d rows in %.1f s", k, summary["rows"], time.monotonic() - started)
    return uri


def _route(chunk: Any, cids: np.ndarray, assigner: Assigner, own: dict[int, tuple[np.ndarray, int, int]],
           pieces: _Pieces, n_train: int, width: int) -> None:
    """Assign one chunk and write what it emits (``shard._route``, with rows of other parts)."""
    emitted, split, shard, local, outside, payload, ids = assign_chunk(chunk, cids, assigner, own)
    n = len(chunk.row_ids)
    elsewhere = np.zeros(len(emitted), bool)
    extra = []
    for i in outside:  # released rows held from earlier chunks (this part's) or parts (an insert)
        h = int(emitted[i])
        if h in own:
            extra.append(own.pop(h))
            local[i] = n + len(extra) - 1
        else:
            elsewhere[i] = True
            local[i] = 0
    if extra:
        payload = np.concatenate([payload, np.stack([e[0] for e in extra])])
        cids = np.concatenate([cids, [e[1] for e in extra]])
        ids = np.concatenate([ids, np.array([e[2] for e in extra], np.uint64)])
    if not len(payload):
        payload = np.zeros((1, width), np.float32)
        cids, ids = np.zeros(1, np.int64), np.zeros(1, np.uint64)
    dest = np.where(split == TRAIN, shard, n_train - 1 + split)
    pieces.write(dest, local, payload, cids, emitted, ids, elsewhere)


# -- merge ----------------------------------------------------------------------------------------

def merge(cfg: TrainConfig, plan_uri: str) -> dict[str, Any]:
    """Assemble every shard from the parts' pieces, upload it, then commit the manifest (last, as
    ``shard._commit`` does) and remove the parts' folder; returns the manifest."""
    doc = _load(plan_uri)
    done = _existing_manifest(doc["prefix"])
    if done is not None and done.get("source_fingerprint") == doc["fingerprint"]:  # a retry after the commit
        storage.delete_prefix(doc["work"])
        return done
    state = _state(cfg, doc)
    if state.rows == 0:
        raise DataError(f"source dataset has no rows (header only): {doc['spec']}")
    splan = _source(doc)
    layout = Layout(**doc["layout"])
    regression = cfg.model.task == "regression"
    names, n_train = _names(cfg), cfg.num_train_shards
    summaries = [_load(_uri(doc, f"part-{k:05d}.json")) for k in range(len(doc["parts"]))]
    aside = _carried(doc, len(summaries))
    tail, tail_shard = _tail(cfg, state, aside)
    counts = [sum(s["pieces"][name]["emitted"] for s in summaries) + int((tail_shard == d).sum())
              for d, name in enumerate(names)]
    _check_counts(counts, [] if regression else state.values, doc["spec"], n_train, regression)
    prep = _fit_preprocessing(cfg, doc, layout, state, summaries)
    imputed: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory(prefix="merge-") as tmp:
        entries = [_write_shard(cfg, doc, layout, d, name, counts[d], summaries, aside, tail[tail_shard == d], prep,
                                state, imputed, tmp)
                   for d, name in enumerate(names)]
    if prep is not None:
        prep["imputed"] = imputed
        if imputed:
            log.info("imputed missing values (train medians / most frequent values): %s", imputed)
    progress = _Progress(splan.total_bytes)
    progress.add_bytes(splan.total_bytes)
    reader = SimpleNamespace(layout=layout, rows=state.rows, files_read=_files_read(splan, summaries),
                             id_column=layout.id_column)
    block = SplitBlock.from_fractions(cfg.data.val_fraction, cfg.data.test_fraction)
    manifest = _manifest(splan, cfg, sharding_params(cfg), doc["fingerprint"], reader, prep,
                         [] if regression else state.values, entries, block, progress)
    committed = _commit(json.loads(to_json_bytes(manifest)), doc["prefix"])
    storage.delete_prefix(doc["work"])
    return committed


def _carried(doc: dict[str, Any], n_parts: int) -> dict[int, tuple[np.ndarray, int, int]]:
    """The rows every part set aside (their place was decided by a later part), by handle:
    ``(payload, class id, id hash)``."""
    carried = [_get_npz(_uri(doc, f"carried-{k:05d}.npz")) for k in range(n_parts)]
    return {int(h): (z["payload"][i], int(z["classes"][i]), int(z["ids"][i]))
            for z in carried for i, h in enumerate(z["handles"])}


def _tail(cfg: TrainConfig, state: _State, aside: dict[int, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Classes of under 3 rows: all train, dealt after every other row, in row order
    (``Assigner.finish``); their handles and the shard each goes to."""
    assigner = _assigner(cfg, state.values)
    small = {c for c, n in state.totals.items() if n < 3}
    assigner.resume({}, {c: sorted(h for h, v in aside.items() if v[1] == c) for c in small}, state.trained[-1])
    tail, _, tail_shard = assigner.finish()
    return tail, tail_shard


def _fit_preprocessing(cfg: TrainConfig, doc: dict[str, Any], layout: Layout, state: _State,
                       summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The preprocessing record fitted from the parts' partial statistics (exact sums, so the
    record does not depend on how the source was cut), or None when the data needs none."""
    if not preprocess.needed(cfg.data, layout):
        return None
    merged = preprocess.merge_partials([{**s["partial"], "values": _get_npz(_uri(doc, f"values-{k:05d}.npz"))}
                                        for k, s in enumerate(summaries)])
    prep = preprocess.fit_from_partial(merged, layout, state.codes, cfg.data)
    if layout.target_columns and cfg.data.standardize:
        moments: list[preprocess.Moments] = [(0, 0, 0, 0)] * len(layout.target_columns)
        for s in summaries:
            moments = [preprocess.add_moments(a, b) for a, b in zip(moments, s["targets"])]
        prep["targets"] = preprocess.targets_record(moments, list(layout.target_columns))
    return prep


def _write_shard(cfg: TrainConfig, doc: dict[str, Any], layout: Layout, d: int, name: str, count: int,
                 summaries: list[dict[str, Any]], aside: dict[int, Any], tail: np.ndarray, prep: dict[str, Any] | None,
                 state: _State, imputed: dict[str, dict[str, int]], tmp: str) -> dict[str, Any]:
    """Shard ``name``: every part's piece in part order, then its tail rows, preprocessed and
    written as one record file, uploaded; its manifest entry. Counts of imputed values are added
    to ``imputed`` by split."""
    split = "train" if name.startswith("train") else name
    nf = len(layout.feature_columns)
    width = nf + len(layout.target_columns)
    slots = preprocess.category_slots(prep, state.codes) if prep else {}
    idx, rec = os.path.join(tmp, f"{name}.idx"), os.path.join(tmp, f"{name}.rec")
    hist: dict[int, int] = {}

    def emit(X: np.ndarray, labels: np.ndarray, row_ids: np.ndarray, hashes: np.ndarray) -> None:
        if prep is not None:
            Xt, got = preprocess.transform(prep, X[:, :nf], slots)
            for col, c in got.items():
                imputed.setdefault(split, {})[col] = imputed.get(split, {}).get(col, 0) + c
            X = np.hstack([Xt, X[:, nf:]]) if width > nf else Xt
        for c, n in zip(*np.unique(labels, return_counts=True)):
            hist[int(c)] = hist.get(int(c), 0) + int(n)
        writer.write_batch(X, labels, row_ids, hashes)

    with record_codec.RecordWriter(idx, rec) as writer:
        for k, s in enumerate(summaries):
            _assemble(doc, k, name, s["pieces"][name], aside, width, cfg.data.chunk_rows, tmp, emit)
        if len(tail):
            emit(np.stack([aside[int(h)][0] for h in tail]), np.array([aside[int(h)][1] for h in tail]),
                 tail, np.array([aside[int(h)][2] for h in tail], np.uint64))
    files = {}
    for kind, path in (("rec", rec), ("idx", idx)):
        storage.upload_file(path, storage.join(doc["prefix"], os.path.basename(path)))
        files[kind] = {"name": os.path.basename(path), "bytes": os.path.getsize(path),
                       "sha256": storage.sha256_file(path)}
        os.unlink(path)
    return {"name": name, "split": split, "count": count,
            "label_histogram": {str(c): hist[c] for c in sorted(hist)}, "files": files}


def _assemble(doc: dict[str, Any], k: int, name: str, piece: dict[str, Any], aside: dict[int, Any], width: int,
              rows: int, tmp: str, emit: Any) -> None:
    """Part ``k``'s piece of shard ``name`` in order, with its inserts put back at their places."""
    inserts = piece["inserts"]  # [place among the piece's emitted rows, row number], in place order
    # An insert's place among the piece's *written* rows: its place less the inserts before it.
    before = [place - j for j, (place, _) in enumerate(inserts)]
    j = 0
    if piece["written"]:
        paths = []
        for ext in ("idx", "rec"):
            path = os.path.join(tmp, f"piece.{ext}")
            storage.download_file(_uri(doc, f"part-{k:05d}/{name}.{ext}"), path)
            paths.append(path)
        start = 0
        for block in record_codec.iter_blocks(paths[0], paths[1], width, rows):
            stop = start + len(block.row_ids)
            at = []
            while j < len(inserts) and before[j] < stop:
                at.append(j)
                j += 1
            X, y, r, h = block.features, block.labels, block.row_ids, block.id_hashes
            if at:
                where = [before[i] - start for i in at]
                got = [aside[inserts[i][1]] for i in at]
                X = np.insert(X, where, np.stack([g[0] for g in got]), axis=0)
                y = np.insert(y, where, [g[1] for g in got])
                r = np.insert(r, where, [inserts[i][1] for i in at])
                h = np.insert(h, where, np.array([g[2] for g in got], np.uint64))
            emit(X, y, r, h)
            start = stop
        for path in paths:
            os.unlink(path)
    if j < len(inserts):  # inserts after the piece's last written row
        got = [aside[inserts[i][1]] for i in range(j, len(inserts))]
        emit(np.stack([g[0] for g in got]), np.array([g[1] for g in got]),
             np.array([inserts[i][1] for i in range(j, len(inserts))], np.int64),
             np.array([g[2] for g in got], np.uint64))


def _files_read(splan: sources.SourcePlan, summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The source files as the manifest lists them. One CSV file cut by byte ranges has no part
    that read it whole: its sha256 is the plan's (local files are hashed by the listing), else
    unknown (its store's identity, the ETag, is in the fingerprint). That holds for one part too,
    so the manifest is the same for any number of parts."""
    if _splittable(splan):
        f = splan.files[0]
        return [{"uri": f.uri, "bytes": f.bytes, "sha256": f.sha256, **({"etag": f.etag} if f.etag else {})}]
    return [f for s in summaries for f in s["files_read"]]


def shard_in_parts(cfg: TrainConfig, root: str, parts: int = 0) -> tuple[str, dict[str, Any], bool]:
    """The four steps in one process: ``(prefix, manifest, reused)``, as ``shard_content_addressed``."""
    from data_checks.shard import shard_content_addressed

    planned = plan(cfg, root, parts)
    if planned["reused"]:
        return planned["prefix"], load_manifest(planned["prefix"]), True
    if not planned["parts"]:  # an image folder: one pass
        return shard_content_addressed(cfg, root)
    for k in planned["parts"]:
        count(cfg, planned["plan_uri"], k)
    for k in planned["parts"]:
        shard_part(cfg, planned["plan_uri"], k)
    return planned["prefix"], merge(cfg, planned["plan_uri"]), False
