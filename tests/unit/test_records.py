"""The numpy RecordIO codec against MXNet's own writer and reader (no servers)."""
from __future__ import annotations

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import numpy as np
import pytest

from common import record_codec

pytestmark = pytest.mark.unit

MAGIC_AS_FLOAT = np.array([record_codec.MAGIC], "<u4").view("<f4")[0]


def mxnet_pair(tmp_path, name: str, X: np.ndarray, y: np.ndarray, ids: np.ndarray, hashes: np.ndarray):
    from common.mx import import_mxnet

    mx = import_mxnet()
    idx, rec = str(tmp_path / f"{name}.idx"), str(tmp_path / f"{name}.rec")
    rio = mx.recordio.MXIndexedRecordIO(idx, rec, "w")
    for i in range(len(y)):
        header = mx.recordio.IRHeader(0, float(y[i]), int(ids[i]), int(hashes[i]))
        rio.write_idx(i, mx.recordio.pack(header, X[i].astype("<f4").tobytes()))
    rio.close()
    return idx, rec


@pytest.mark.parametrize("with_magic", [False, True])
def test_batch_writer_writes_mxnet_bytes_and_reads_them_back(tmp_path, with_magic):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 9)).astype(np.float32)
    y, ids = rng.integers(0, 7, 40), rng.integers(0, 10**9, 40)
    hashes = rng.integers(0, 2**63, 40).astype(np.uint64)
    if with_magic:  # dmlc escapes a payload word equal to the magic number by splitting the record
        X[3, 0] = X[3, 8] = MAGIC_AS_FLOAT
        X[17, :] = MAGIC_AS_FLOAT
        hashes[30] = record_codec.MAGIC
    idx, rec = str(tmp_path / "ours.idx"), str(tmp_path / "ours.rec")
    with record_codec.RecordWriter(idx, rec) as writer:
        writer.write_batch(X[:25], y[:25], ids[:25], hashes[:25])
        writer.write(X[25], int(y[25]), int(ids[25]), int(hashes[25]))
        writer.write_batch(X[26:], y[26:], ids[26:], hashes[26:])
    ref_idx, ref_rec = mxnet_pair(tmp_path, "ref", X, y, ids, hashes)
    assert open(idx, "rb").read() == open(ref_idx, "rb").read()
    assert open(rec, "rb").read() == open(ref_rec, "rb").read()

    shard = record_codec.read_shard(idx, rec, 9)
    np.testing.assert_array_equal(shard.features, X)
    np.testing.assert_array_equal(shard.labels, y)
    np.testing.assert_array_equal(shard.row_ids, ids)
    np.testing.assert_array_equal(shard.id_hashes, hashes)
    with pytest.raises(ValueError, match="has 9 features, expected 8"):
        record_codec.read_shard(idx, rec, 8)


def test_labels_are_rewritten_in_place(tmp_path):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(12, 3)).astype(np.float32)
    X[5, 1] = MAGIC_AS_FLOAT  # an escaped record must keep its label position
    y = np.arange(12) % 4
    idx, rec = str(tmp_path / "a.idx"), str(tmp_path / "a.rec")
    with record_codec.RecordWriter(idx, rec) as writer:
        writer.write_batch(X, y, np.arange(12))
    record_codec.rewrite_labels(idx, rec, np.array([3, 2, 1, 0]))
    X2, y2, ids2 = record_codec.read_all(idx, rec, 3)
    np.testing.assert_array_equal(y2, 3 - y)
    np.testing.assert_array_equal(X2, X)
    np.testing.assert_array_equal(ids2, np.arange(12))
