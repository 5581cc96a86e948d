"""Great Expectations validation of committed shards (local paths; no servers)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits

import numpy as np
import pandas as pd
import pytest

from common import storage
from common.records import RecordWriter
from data_checks import DataValidationError
from data_checks.shard import shard_dataset
from data_checks.validate import validate_shards
from training.config import DataConfig, TrainConfig

pytestmark = pytest.mark.unit


def digits_frame() -> pd.DataFrame:
    d = load_digits()
    df = pd.DataFrame(d.data, columns=[f"pixel_{i}" for i in range(64)])
    df["label"] = d.target
    return df


def config(source: str = "", **data: object) -> TrainConfig:
    return TrainConfig(data=DataConfig(source_uri=source, label_column="label", **data))


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, str]:
    root = tmp_path_factory.mktemp("digits")
    digits_frame().to_csv(root / "digits.csv", index=False)
    cfg = config(str(root / "digits.csv"))
    shard_dataset(cfg, str(root / "shards"))
    return cfg, str(root / "shards")


def shard_bad_source(tmp_path, edit) -> tuple[TrainConfig, str]:
    frame = digits_frame()
    edit(frame)
    frame.to_csv(tmp_path / "bad.csv", index=False)
    cfg = config(str(tmp_path / "bad.csv"))
    shard_dataset(cfg, str(tmp_path / "shards"))
    return cfg, str(tmp_path / "shards")


def write_manual_shards(prefix: str, parts: list[tuple[str, str, np.ndarray, np.ndarray]],
                        num_classes: int) -> None:
    """Shards written by hand (RecordWriter + a manifest), to test validation apart from the sharder."""
    entries, next_id = [], 0
    num_features = parts[0][2].shape[1]
    with tempfile.TemporaryDirectory() as tmp:
        for name, split, X, y in parts:
            files = {}
            idx, rec = os.path.join(tmp, f"{name}.idx"), os.path.join(tmp, f"{name}.rec")
            with RecordWriter(idx, rec) as w:
                for feats, label in zip(X, y):
                    w.write(feats, int(label), next_id)
                    next_id += 1
            for kind, path in (("rec", rec), ("idx", idx)):
                storage.upload_file(path, storage.join(prefix, os.path.basename(path)))
                files[kind] = {"name": os.path.basename(path), "bytes": os.path.getsize(path),
                               "sha256": storage.sha256_file(path)}
            entries.append({"name": name, "split": split, "count": len(y), "label_histogram": {}, "files": files})
    manifest = {
        "format_version": 1, "source_uri": "hand-made", "source_sha256": "0" * 64, "label_column": "label",
        "feature_columns": [f"f{i}" for i in range(num_features)], "num_features": num_features,
        "input_shape": [], "classes": list(range(num_classes)), "num_classes": num_classes,
        "splits": {s: {"count": sum(e["count"] for e in entries if e["split"] == s)} for s in ("train", "val", "test")},
        "shards": entries,
    }
    storage.put_bytes(storage.join(prefix, "manifest.json"), json.dumps(manifest).encode())


def rows(n: int, rng: np.random.Generator, num_classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    return rng.random((n, 4), dtype=np.float32), rng.integers(0, num_classes, n)


def test_digits_pass_and_the_report_is_written(digits, tmp_path):
    cfg, prefix = digits
    summary = validate_shards(prefix, cfg, report_prefix=str(tmp_path / "validation"))
    assert summary["success"] and summary["failed"] == 0 and summary["evaluated"] >= 8
    assert summary["report_uri"] == str(tmp_path / "validation" / "validation.json")
    report = json.loads(open(summary["report_uri"]).read())
    assert report["success"] and report["great_expectations"]["success"]
    assert report["great_expectations"]["statistics"]["evaluated_expectations"] == 7
    assert {c["check"] for c in report["checks"]} >= {"shard_files_match_manifest", "train_shards_balanced"}
    # Without a report prefix nothing is written.
    assert validate_shards(prefix, cfg)["report_uri"] is None


@pytest.mark.parametrize("value, shown", [(np.nan, "pixel_5=nan"), (np.inf, "pixel_5=inf"), (-np.inf, "pixel_5=-inf")])
def test_non_finite_features_fail_naming_the_column(value, shown, tmp_path):
    def edit(frame: pd.DataFrame) -> None:
        frame.loc[[10, 700], "pixel_5"] = value

    cfg, prefix = shard_bad_source(tmp_path, edit)
    with pytest.raises(DataValidationError) as info:
        validate_shards(prefix, cfg, report_prefix=str(tmp_path / "validation"))
    message = str(info.value)
    assert "every feature is finite" in message and "columns pixel_5 (2)" in message
    assert f"row 10: {shown}" in message and "2 of 1797 unexpected" in message
    [failure] = info.value.failures
    assert failure["columns"] == ["pixel_5"] and failure["column_counts"] == {"pixel_5": 2}
    assert failure["unexpected_count"] == 2
    report = json.loads(open(tmp_path / "validation" / "validation.json").read())  # strict JSON despite NaN/inf
    assert report["success"] is False and report["failures"][0]["columns"] == ["pixel_5"]
    assert pickle.loads(pickle.dumps(info.value)).failures == info.value.failures


def test_label_out_of_range_fails(digits, tmp_path):
    cfg, prefix = digits
    shutil.copytree(prefix, tmp_path / "shards")
    manifest_path = tmp_path / "shards" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["num_classes"] = 9  # label 9 is now out of range
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataValidationError, match=r"expect_column_values_to_be_in_set\(label\).*e\.g\. \[9, 9") as info:
        validate_shards(str(tmp_path / "shards"), cfg)
    assert [f["expectation"] for f in info.value.failures] == ["expect_column_values_to_be_in_set"]
    assert info.value.failures[0]["unexpected_count"] == (digits_frame()["label"] == 9).sum()


def test_hand_written_bad_labels_and_duplicate_rows_fail(tmp_path):
    rng = np.random.default_rng(0)
    X, y = rows(40, rng)
    y[3] = 7
    write_manual_shards(str(tmp_path), [("train-00000", "train", X[:20], y[:20]), ("train-00001", "train", X[20:30], y[20:30]),
                                        ("val", "val", X[30:35], y[30:35]), ("test", "test", X[35:], y[35:])], num_classes=3)
    with pytest.raises(DataValidationError, match=r"labels are class indices 0\.\.2.*1 of 40 unexpected; e\.g\. \[7\]"):
        validate_shards(str(tmp_path), config())


@pytest.mark.parametrize("sizes, match", [
    ((30, 5), r"train_shards_balanced: 1 train shard\(s\) hold more than 26\.2 rows"),
    ((30, 0), r"every shard in the manifest holds at least one row.*e\.g\. \['train-00001'\]"),
])
def test_unbalanced_or_empty_train_shards_fail(sizes, match, tmp_path):
    rng = np.random.default_rng(1)
    (X0, y0), (X1, y1), (Xv, yv) = rows(sizes[0], rng), rows(sizes[1], rng), rows(6, rng)
    write_manual_shards(str(tmp_path), [("train-00000", "train", X0, y0), ("train-00001", "train", X1, y1),
                                        ("val", "val", Xv[:3], yv[:3]), ("test", "test", Xv[3:], yv[3:])], num_classes=3)
    with pytest.raises(DataValidationError, match=match):
        validate_shards(str(tmp_path), config())


def test_corrupted_shard_fails_with_sha256(digits, tmp_path):
    cfg, prefix = digits
    shutil.copytree(prefix, tmp_path / "shards")
    path = tmp_path / "shards" / "train-00001.rec"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataValidationError, match=r"sha256 mismatch for .*train-00001\.rec") as info:
        validate_shards(str(tmp_path / "shards"), cfg, report_prefix=str(tmp_path / "validation"))
    assert [f["shard"] for f in info.value.failures] == ["train-00001"]
    report = json.loads(open(tmp_path / "validation" / "validation.json").read())
    assert "skipped" in report["great_expectations"]
