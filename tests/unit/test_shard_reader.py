"""The memory-mapped shard reader against ``record_codec.read_all`` (local files; no servers)."""
from __future__ import annotations

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import logging
import shutil

import numpy as np
import pandas as pd
import pytest

from common import record_codec
from common.manifest import download_shard
from data_checks.shard import shard_dataset
from training.feed import data
from common.config import ClusterConfig, DataConfig, TrainConfig
from training.feed.shard_reader import LoadedShard, MappedShard, ShardSet, open_shard

pytestmark = pytest.mark.unit

MAGIC_AS_FLOAT = np.array([record_codec.MAGIC], "<u4").view("<f4")[0]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    rng = np.random.default_rng(3)
    df = pd.DataFrame(rng.normal(size=(400, 6)).astype(np.float32), columns=[f"f{i}" for i in range(6)])
    df["label"] = rng.integers(0, 4, len(df))
    src = str(tmp_path_factory.mktemp("src") / "table.csv")
    df.to_csv(src, index=False)
    cfg = TrainConfig(cluster=ClusterConfig(num_workers=2),
                      data=DataConfig(source_uri=src, label_column="label", num_shards=4))
    prefix = str(tmp_path_factory.mktemp("shards") / "run")
    return prefix, shard_dataset(cfg, prefix)


def test_mapped_shards_equal_read_all_and_gather_like_the_concatenated_split(sharded, tmp_path):
    prefix, manifest = sharded
    f = manifest["num_features"]
    shards = data.shards_for_rank(manifest, 1, 2)  # two train shards: the multi-shard path
    assert len(shards) == 2
    loaded = []
    for s in shards:
        idx, rec = download_shard(manifest, prefix, s["name"], str(tmp_path))
        source, labels = open_shard(idx, rec, f)
        X, y, _ = record_codec.read_all(idx, rec, f)
        assert isinstance(source, MappedShard) and source.num_rows == len(y) == s["count"]
        np.testing.assert_array_equal(source.features(np.arange(len(y))), X)
        np.testing.assert_array_equal(labels, y)
        loaded.append((X, y))
    X, y = np.concatenate([a for a, _ in loaded]), np.concatenate([b for _, b in loaded])

    work = tmp_path / "work"
    work.mkdir()
    rows = data.open_split(manifest, prefix, shards, str(work))
    shutil.rmtree(work)  # the worker removes its download folder; the mapping keeps the pages readable
    assert rows.num_rows == len(y)
    idx = np.random.default_rng(0).integers(0, len(y), 97)
    idx[:3] = [len(y) - 1, 0, 0]  # both ends, a repeat
    Xg, yg = rows.gather(idx)
    assert Xg.dtype == np.float32 and Xg.flags.c_contiguous and yg.dtype == np.int32
    np.testing.assert_array_equal(Xg, X[idx])
    np.testing.assert_array_equal(yg, y[idx])


def test_a_shard_without_the_fixed_layout_is_loaded_into_memory_with_a_warning(tmp_path, caplog):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(30, 5)).astype(np.float32)
    X[7, 2] = MAGIC_AS_FLOAT  # dmlc splits this record: the shard's records differ in size
    y = np.arange(30) % 3
    idx, rec = str(tmp_path / "a.idx"), str(tmp_path / "a.rec")
    with record_codec.RecordWriter(idx, rec) as writer:
        writer.write_batch(X, y, np.arange(30))
    with pytest.raises(record_codec.LayoutError, match="not 52 bytes apart"):
        record_codec.scan_fixed_layout(idx, rec, 5)
    with caplog.at_level(logging.WARNING, logger="training.feed.shard_reader"):
        source, labels = open_shard(idx, rec, 5)
    assert isinstance(source, LoadedShard)
    assert "loaded into memory" in caplog.text and "a.rec" in caplog.text
    rows = ShardSet([source], [labels], 5)
    Xg, yg = rows.gather(np.array([7, 0, 29]))
    np.testing.assert_array_equal(Xg, X[[7, 0, 29]])
    np.testing.assert_array_equal(yg, y[[7, 0, 29]])


def test_a_record_framed_differently_is_refused_by_the_scan(tmp_path):
    X = np.ones((4, 2), np.float32)
    idx, rec = str(tmp_path / "b.idx"), str(tmp_path / "b.rec")
    with record_codec.RecordWriter(idx, rec) as writer:
        writer.write_batch(X, np.zeros(4), np.arange(4))
    words = np.memmap(rec, dtype="<u4", mode="r+")
    words[(8 + record_codec.record_bytes(2)) // 4 * 2 + 2] = 1  # record 2's flag word
    words.flush()
    del words
    with pytest.raises(record_codec.LayoutError, match="near row 0"):
        record_codec.scan_fixed_layout(idx, rec, 2)
    with pytest.raises(ValueError, match="record 2"):  # the fallback reader refuses it too
        open_shard(idx, rec, 2)


def test_an_empty_shard_opens(tmp_path):
    idx, rec = str(tmp_path / "e.idx"), str(tmp_path / "e.rec")
    record_codec.RecordWriter(idx, rec).close()
    source, labels = open_shard(idx, rec, 3)
    assert source.num_rows == 0 and len(labels) == 0
