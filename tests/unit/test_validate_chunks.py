"""A shard validated a chunk at a time (``data_checks.validate.validate_shard``'s ``chunk_bytes``)
gives the result of one GX run over the whole shard: the same checks, failures and counts, also
for what only the whole shard shows (a row id repeated across chunks, a short shard)."""
from __future__ import annotations

import json
import os

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import numpy as np
import pandas as pd
import pytest

from common import storage
from common.config import DataConfig, TrainConfig
from common.record_codec import RecordWriter, record_bytes
from data_checks.shard import shard_dataset
from data_checks.validate import validate_shard
from testkit.digits import digits_frame

pytestmark = pytest.mark.unit


def config(source: str) -> TrainConfig:
    return TrainConfig(data=DataConfig(source_uri=source, label_column="label"))


def sharded(root, edit=None) -> tuple[TrainConfig, str, dict]:
    frame = digits_frame()
    if edit is not None:
        edit(frame)
    frame.to_csv(root / "digits.csv", index=False)
    cfg = config(str(root / "digits.csv"))
    return cfg, str(root / "shards"), shard_dataset(cfg, str(root / "shards"))


def chunk(manifest: dict, rows: int) -> int:
    """``chunk_bytes`` for chunks of ``rows`` records."""
    return rows * record_bytes(manifest["num_features"])


def summary(outcome) -> dict:
    r = dict(outcome.result)
    failures = [(f["expectation"], f["column"], f.get("unexpected_count"), f.get("column_counts"),
                 f.get("observed_value")) for f in r["failures"]]
    ge = r["great_expectations"]
    return {"success": r["success"], "rows": r["rows"], "evaluated": r["evaluated"], "failures": failures,
            "label_histogram": r["label_histogram"], "label_rows": r["label_rows"],
            "statistics": {k: ge["statistics"][k] for k in ("evaluated_expectations", "successful_expectations")},
            "expectations": [(e["expectation_config"]["type"], e["success"]) for e in ge["results"]]}


def test_good_shards_in_chunks_equal_one_run(tmp_path):
    cfg, prefix, manifest = sharded(tmp_path)
    for entry in manifest["shards"][:1] + manifest["shards"][-1:]:  # a train shard and the test split
        whole = validate_shard(prefix, entry["name"], cfg)
        chunked = validate_shard(prefix, entry["name"], cfg, chunk_bytes=chunk(manifest, 250))
        assert whole.result["chunks"] == 1 and chunked.result["chunks"] == -(-entry["count"] // 250) > 1
        assert summary(chunked) == summary(whole) and whole.result["success"]


def test_non_finite_values_in_later_chunks_fail_as_in_one_run(tmp_path):
    def edit(frame: pd.DataFrame) -> None:
        frame.loc[[10, 700, 1500], "pixel_5"] = np.nan

    cfg, prefix, manifest = sharded(tmp_path, edit)
    failed = 0
    for entry in manifest["shards"]:
        whole = validate_shard(prefix, entry["name"], cfg)
        chunked = validate_shard(prefix, entry["name"], cfg, chunk_bytes=chunk(manifest, 250))
        assert summary(chunked) == summary(whole)
        failed += not whole.result["success"]
        examples = [e for f in chunked.result["failures"] for e in f["examples"]]
        assert all("pixel_5=nan" in e for e in examples)
    assert failed >= 1


def write_shard(prefix: str, row_ids: list[int], count: int) -> None:
    """One hand-written test shard with these row ids; the manifest says it holds ``count`` rows."""
    X = np.random.default_rng(0).random((len(row_ids), 3), dtype=np.float32)
    y = np.arange(len(row_ids)) % 2
    os.makedirs(prefix, exist_ok=True)
    idx, rec = os.path.join(prefix, "test.idx"), os.path.join(prefix, "test.rec")
    with RecordWriter(idx, rec) as w:
        for feats, label, rid in zip(X, y, row_ids):
            w.write(feats, int(label), rid)
    files = {kind: {"name": os.path.basename(p), "bytes": os.path.getsize(p), "sha256": storage.sha256_file(p)}
             for kind, p in (("rec", rec), ("idx", idx))}
    hist = {str(k): int(c) for k, c in zip(*np.unique(y, return_counts=True))}
    manifest = {"format_version": 1, "source_uri": "hand-made", "label_column": "label",
                "feature_columns": ["a", "b", "c"], "num_features": 3, "input_shape": [], "classes": [0, 1],
                "num_classes": 2, "splits": {"test": {"count": count}},
                "shards": [{"name": "test", "split": "test", "count": count, "label_histogram": hist,
                            "files": files}]}
    with open(os.path.join(prefix, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)


def test_a_row_id_repeated_across_chunks_fails_as_in_one_run(tmp_path):
    ids = list(range(100))
    ids[80] = 5  # chunks of 50 rows: the repeat is in another chunk than the first
    write_shard(str(tmp_path / "s"), ids, 100)
    cfg = config("hand-made")
    whole = validate_shard(str(tmp_path / "s"), "test", cfg)
    chunked = validate_shard(str(tmp_path / "s"), "test", cfg, chunk_bytes=50 * record_bytes(3))
    assert chunked.result["chunks"] == 2
    unique = [f for f in chunked.result["failures"] if f["expectation"] == "expect_column_values_to_be_unique"]
    assert unique and unique[0]["unexpected_count"] == 2 and 5 in unique[0]["examples"]
    assert summary(chunked) == summary(whole)


def test_a_short_shard_fails_its_row_count_as_in_one_run(tmp_path):
    write_shard(str(tmp_path / "s"), list(range(100)), 103)  # the manifest says 3 rows more
    cfg = config("hand-made")
    whole = validate_shard(str(tmp_path / "s"), "test", cfg)
    chunked = validate_shard(str(tmp_path / "s"), "test", cfg, chunk_bytes=40 * record_bytes(3))
    assert chunked.result["chunks"] == 3
    counts = [f for f in chunked.result["failures"] if f["expectation"] == "expect_table_row_count_to_equal"]
    assert counts and counts[0]["observed_value"] == 100
    assert summary(chunked) == summary(whole)
