"""The record codec shared by the sharder (writer) and the trainer (reader).

One example = one MXNet RecordIO record: an ``IRHeader`` (``flag=0``, ``label`` = class index,
``id`` = source row number, ``id2`` = 64-bit hash of the declared id column, else 0) followed
by the features as little-endian float32 bytes. Files are ``.rec`` + ``.idx`` pairs readable
with ``mx.recordio.MXIndexedRecordIO``.

Why not write through ``MXIndexedRecordIO``: it costs one Python call and one ctypes call per
record (about 15 s per million records here), and every record of a shard has the same size.
This module writes whole batches with numpy and produces the same bytes as MXNet (the test
suite compares them), including dmlc's escaping of a payload word equal to the RecordIO magic
number. Reading takes the same shortcut when a file has the fixed-size layout and falls back
to MXNet otherwise. mxnet is imported lazily: importing this module costs nothing.
"""
from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import numpy as np

MAGIC = 0xCED7230A
# struct 'IfQQ': flag uint32, label float32, id uint64, id2 uint64 (no padding: 8 is aligned).
HEADER_BYTES = 24
_LEN_MASK = (1 << 29) - 1
_LABEL_OFFSET = 8 + 4  # from a record's start: magic, lrec, then flag, label


class Shard(NamedTuple):
    features: np.ndarray  # [n, num_features] float32
    labels: np.ndarray  # [n] int32 class indices
    row_ids: np.ndarray  # [n] int64 source row numbers
    id_hashes: np.ndarray  # [n] uint64; 0 when no id column was declared


def _recordio() -> Any:
    from common.mx import import_mxnet

    return import_mxnet().recordio


def record_bytes(num_features: int) -> int:
    """Bytes of one record's payload (header + features), before RecordIO framing."""
    return HEADER_BYTES + 4 * num_features


def pack(features: np.ndarray, label: int, row_id: int, id_hash: int = 0) -> bytes:
    header = struct.pack("<IfQQ", 0, float(label), int(row_id), int(id_hash))
    return header + np.ascontiguousarray(features, dtype="<f4").tobytes()


def unpack(record: bytes, num_features: int) -> tuple[np.ndarray, int, int]:
    flag, label, row_id, _ = struct.unpack("<IfQQ", record[:HEADER_BYTES])
    feats = np.frombuffer(record, dtype="<f4", offset=HEADER_BYTES)
    if flag != 0 or feats.size != num_features:
        raise ValueError(f"record {row_id} has {feats.size} features, expected {num_features}")
    return feats, int(label), int(row_id)


def _frame_escaped(data: bytes) -> bytes:
    """dmlc RecordIOWriter::WriteRecord for a payload holding the magic word at an aligned offset.

    The payload is cut at every such word (the word itself is dropped and restored by the
    reader); parts carry cflag 1 (first), 2 (middle), 3 (last).
    """
    magic = struct.pack("<I", MAGIC)
    out, start, n = [], 0, len(data)
    for i in range(0, (n >> 2) << 2, 4):
        if data[i:i + 4] == magic:
            out += [magic, struct.pack("<I", ((1 if start == 0 else 2) << 29) | (i - start)), data[start:i]]
            start = i + 4
    out += [magic, struct.pack("<I", ((3 if start else 0) << 29) | (n - start)), data[start:]]
    out.append(b"\0" * (-n % 4))
    return b"".join(out)


class RecordWriter:
    """Writes an indexed RecordIO pair batch by batch; ``close()`` flushes both files."""

    def __init__(self, idx_path: str, rec_path: str) -> None:
        self._rec = open(rec_path, "wb")
        self._idx = open(idx_path, "w")
        self.count = 0
        self.bytes = 0

    def write(self, features: np.ndarray, label: int, row_id: int, id_hash: int = 0) -> None:
        self.write_batch(np.asarray(features, np.float32)[None, :], np.array([label]), np.array([row_id]),
                         np.array([id_hash], np.uint64))

    def write_batch(self, X: np.ndarray, labels: np.ndarray, row_ids: np.ndarray,
                    id_hashes: np.ndarray | None = None) -> None:
        n, width = X.shape
        if n == 0:
            return
        length = record_bytes(width)
        if length > _LEN_MASK:
            raise ValueError(f"a record of {width} features exceeds RecordIO's 2**29-byte limit")
        words = np.empty((n, 2 + length // 4), dtype="<u4")
        words[:, 0] = MAGIC
        words[:, 1] = length
        words[:, 2] = 0
        words[:, 3] = np.asarray(labels, dtype="<f4").view("<u4")
        words[:, 4:6] = np.asarray(row_ids, dtype="<u8").view("<u4").reshape(n, 2)
        ids = np.zeros(n, "<u8") if id_hashes is None else np.asarray(id_hashes, dtype="<u8")
        words[:, 6:8] = ids.view("<u4").reshape(n, 2)
        words[:, 8:] = np.asarray(X, dtype="<f4").view("<u4")
        escaped = np.flatnonzero((words[:, 2:] == MAGIC).any(axis=1))
        if len(escaped) == 0:
            sizes = np.full(n, 8 + length, np.int64)
            self._rec.write(memoryview(words).cast("B"))  # no copy
        else:  # rare: a float whose bits equal the magic word; frame those records like dmlc does
            parts = [words[i, 2:].tobytes() for i in escaped]
            framed = [_frame_escaped(p) for p in parts]
            sizes = np.full(n, 8 + length, np.int64)
            sizes[escaped] = [len(f) for f in framed]
            start = 0
            for i, blob in zip(escaped, framed):
                self._rec.write(words[start:i].tobytes())
                self._rec.write(blob)
                start = i + 1
            self._rec.write(words[start:].tobytes())
        lines = np.empty((n, 2), np.int64)
        lines[:, 0] = np.arange(self.count, self.count + n)
        lines[:, 1] = self.bytes + np.concatenate(([0], np.cumsum(sizes)[:-1]))
        self._idx.write(("%d\t%d\n" * n) % tuple(lines.ravel().tolist()))  # MXIndexedRecordIO's format
        self.count += n
        self.bytes += int(sizes.sum())

    def close(self) -> None:
        self._rec.close()
        self._idx.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_index(text: str, idx_path: str) -> np.ndarray:
    values = np.fromstring(text, dtype=np.int64, sep=" ")  # any whitespace separates
    if values.size % 2 or values.size < 2 * text.count("\n"):
        raise ValueError(f"{idx_path} is not a RecordIO index (key<TAB>offset lines)")
    return values.reshape(-1, 2)


def iter_index(idx_path: str, block_bytes: int = 8 << 20) -> Any:
    """``(keys, offsets)`` of an ``.idx`` file in file order, a block of lines at a time."""
    with open(idx_path, "r") as fh:
        rest = ""
        while block := fh.read(block_bytes):
            text = rest + block
            cut = text.rfind("\n") + 1
            rest = text[cut:]
            if cut:
                pairs = _parse_index(text[:cut], idx_path)
                yield pairs[:, 0], pairs[:, 1]
        if rest.strip():
            pairs = _parse_index(rest + "\n", idx_path)
            yield pairs[:, 0], pairs[:, 1]


def read_index(idx_path: str) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, offsets)`` of an ``.idx`` file, sorted by key."""
    with open(idx_path, "r") as fh:
        text = fh.read()
    if not text.strip():
        return np.empty(0, np.int64), np.empty(0, np.int64)
    pairs = _parse_index(text, idx_path)
    order = np.argsort(pairs[:, 0], kind="stable")
    return pairs[order, 0], pairs[order, 1]


def read_shard(idx_path: str, rec_path: str, num_features: int) -> Shard:
    """Load a whole shard in key order. ``ValueError`` when a record has another width."""
    keys, offsets = read_index(idx_path)
    n, length = len(keys), record_bytes(num_features)
    stride = 8 + length
    if n and os.path.getsize(rec_path) == n * stride and np.array_equal(offsets, np.arange(n) * stride):
        words = np.fromfile(rec_path, dtype="<u4").reshape(n, stride // 4)
        if (words[:, 0] == MAGIC).all() and (words[:, 1] == length).all() and (words[:, 2] == 0).all():
            return Shard(words[:, 8:].view("<f4"), words[:, 3].view("<f4").astype(np.int32),
                         np.ascontiguousarray(words[:, 4:6]).view("<u8").ravel().astype(np.int64),
                         np.ascontiguousarray(words[:, 6:8]).view("<u8").ravel())
    return _read_shard_mxnet(idx_path, rec_path, num_features)


class LayoutError(ValueError):
    """A shard is valid RecordIO but not the fixed-size layout (escaped records, another writer)."""


def record_dtype(num_features: int) -> np.dtype:
    """One framed record of the fixed-size layout: RecordIO magic + length word, then the payload."""
    return np.dtype([("magic", "<u4"), ("lrec", "<u4"), ("flag", "<u4"), ("label", "<f4"), ("id", "<u8"),
                     ("id2", "<u8"), ("features", "<f4", (num_features,))])


def scan_fixed_layout(idx_path: str, rec_path: str, num_features: int, block_bytes: int = 8 << 20) -> np.ndarray:
    """Check that a shard has the fixed-size layout, reading it in blocks; returns its labels (int32).

    Raises ``LayoutError`` naming the first thing that breaks it. The file is read, not mapped, so
    the scan leaves no resident pages in the caller's mappings; memory stays at one block.
    """
    dtype = record_dtype(num_features)
    stride = dtype.itemsize
    n = 0
    for keys, offsets in iter_index(idx_path):
        expected = np.arange(n, n + len(keys))
        if not (np.array_equal(keys, expected) and np.array_equal(offsets, expected * stride)):
            raise LayoutError(f"{idx_path}: records are not {stride} bytes apart in key order")
        n += len(keys)
    size = os.path.getsize(rec_path)
    if size != n * stride:
        raise LayoutError(f"{rec_path} has {size} bytes, {n} fixed-size records would be {n * stride}")
    labels = np.empty(n, np.int32)
    rows = max(1, block_bytes // stride)
    with open(rec_path, "rb") as fh:
        for start in range(0, n, rows):
            block = np.fromfile(fh, dtype=dtype, count=min(rows, n - start))
            if not ((block["magic"] == MAGIC).all() and (block["lrec"] == stride - 8).all()
                    and (block["flag"] == 0).all()):
                raise LayoutError(f"{rec_path}: a record near row {start} is framed differently")
            labels[start:start + len(block)] = block["label"]
    return labels


def iter_blocks(idx_path: str, rec_path: str, num_features: int, rows: int) -> Any:
    """A shard's records in key order as ``Shard`` blocks of at most ``rows`` records (memory: one
    block); a shard without the fixed-size layout (rare: an escaped record) comes as one block."""
    try:
        scan_fixed_layout(idx_path, rec_path, num_features)
    except LayoutError:
        yield read_shard(idx_path, rec_path, num_features)
        return
    dtype = record_dtype(num_features)
    n = os.path.getsize(rec_path) // dtype.itemsize
    with open(rec_path, "rb") as fh:
        for start in range(0, n, rows):
            block = np.fromfile(fh, dtype=dtype, count=min(rows, n - start))
            yield Shard(block["features"], block["label"].astype(np.int32), block["id"].astype(np.int64),
                        block["id2"].copy())


def _read_shard_mxnet(idx_path: str, rec_path: str, num_features: int) -> Shard:
    """Any valid RecordIO pair (escaped records, other writers), one record at a time."""
    rio = _recordio().MXIndexedRecordIO(idx_path, rec_path, "r")
    try:
        keys = sorted(rio.keys)
        X = np.empty((len(keys), num_features), dtype=np.float32)
        y = np.empty(len(keys), dtype=np.int32)
        ids = np.empty(len(keys), dtype=np.int64)
        hashes = np.empty(len(keys), dtype=np.uint64)
        for i, k in enumerate(keys):
            record = rio.read_idx(k)
            X[i], y[i], ids[i] = unpack(record, num_features)
            hashes[i] = struct.unpack("<Q", record[16:24])[0]
    finally:
        rio.close()
    return Shard(X, y, ids, hashes)


def read_all(idx_path: str, rec_path: str, num_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Load a whole shard: features ``[n, num_features]`` float32, labels int32, row ids int64."""
    shard = read_shard(idx_path, rec_path, num_features)
    return shard.features, shard.labels, shard.row_ids


def rewrite_labels(idx_path: str, rec_path: str, mapping: np.ndarray) -> None:
    """Replace every record's label ``k`` by ``mapping[k]``, in place.

    The sharder learns the final class order only at the end of the stream. The label field
    sits at the same offset of every record even when dmlc framing split the payload (a split
    happens only at a word equal to the magic number; the flag word is 0 and a class index is
    a small float, so neither is ever that word), so this touches 4 bytes per record.
    """
    if os.path.getsize(rec_path) == 0:
        return
    table = np.asarray(mapping, dtype=np.float32)
    words = np.memmap(rec_path, dtype="<f4", mode="r+")
    try:
        for _, offsets in iter_index(idx_path):  # a block at a time: memory stays bounded
            at = (offsets + _LABEL_OFFSET) // 4
            words[at] = table[words[at].astype(np.int64)]
        words.flush()
    finally:
        del words
