"""The record codec shared by the sharder (writer) and the trainer (reader).

One example = one MXNet RecordIO record: an ``IRHeader`` whose ``label`` is the class index and
whose ``id`` is the source row number, followed by the features as little-endian float32 bytes.
Files are ``.rec`` + ``.idx`` pairs readable with ``mx.recordio.MXIndexedRecordIO``.
mxnet is imported lazily: importing this module costs nothing.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _recordio() -> Any:
    from common.mx import import_mxnet

    return import_mxnet().recordio


def pack(features: np.ndarray, label: int, row_id: int) -> bytes:
    recordio = _recordio()
    header = recordio.IRHeader(0, float(label), int(row_id), 0)
    return recordio.pack(header, np.ascontiguousarray(features, dtype="<f4").tobytes())


def unpack(record: bytes, num_features: int) -> tuple[np.ndarray, int, int]:
    recordio = _recordio()
    header, payload = recordio.unpack(record)
    feats = np.frombuffer(payload, dtype="<f4")
    if feats.size != num_features:
        raise ValueError(f"record {header.id} has {feats.size} features, expected {num_features}")
    return feats, int(header.label), int(header.id)


class RecordWriter:
    """Writes an indexed RecordIO pair; ``close()`` flushes both files."""

    def __init__(self, idx_path: str, rec_path: str) -> None:
        self._rio = _recordio().MXIndexedRecordIO(idx_path, rec_path, "w")
        self.count = 0

    def write(self, features: np.ndarray, label: int, row_id: int) -> None:
        self._rio.write_idx(self.count, pack(features, label, row_id))
        self.count += 1

    def close(self) -> None:
        self._rio.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_all(idx_path: str, rec_path: str, num_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Load a whole shard: features ``[n, num_features]`` float32, labels int32, row ids int64."""
    rio = _recordio().MXIndexedRecordIO(idx_path, rec_path, "r")
    try:
        keys = sorted(rio.keys)
        X = np.empty((len(keys), num_features), dtype=np.float32)
        y = np.empty(len(keys), dtype=np.int32)
        ids = np.empty(len(keys), dtype=np.int64)
        for i, k in enumerate(keys):
            X[i], y[i], ids[i] = unpack(rio.read_idx(k), num_features)
    finally:
        rio.close()
    return X, y, ids
