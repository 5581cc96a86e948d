"""Great Expectations validation of committed shards (local paths; no servers)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import numpy as np
import pandas as pd
import pytest

from common import storage
from common.record_codec import RecordWriter
from data_checks import DataValidationError
from data_checks.shard import shard_dataset
from data_checks.validate import finish_validation, load_outcome, save_outcome, validate_shard, validate_shards
from common.config import DataConfig, TrainConfig
from testkit.digits import digits_frame

pytestmark = pytest.mark.unit


def config(source: str = "", **data: object) -> TrainConfig:
    return TrainConfig(data=DataConfig(source_uri=source, label_column="label", **data))


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, str]:
    root = tmp_path_factory.mktemp("digits")
    digits_frame().to_csv(root / "digits.csv", index=False)
    cfg = config(str(root / "digits.csv"))
    shard_dataset(cfg, str(root / "shards"))
    return cfg, str(root / "shards")


def shard_bad_source(tmp_path, edit, **data: object) -> tuple[TrainConfig, str]:
    frame = digits_frame()
    edit(frame)
    frame.to_csv(tmp_path / "bad.csv", index=False)
    cfg = config(str(tmp_path / "bad.csv"), **data)
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
            hist = {str(k): int(c) for k, c in zip(*np.unique(y, return_counts=True))}
            entries.append({"name": name, "split": split, "count": len(y), "label_histogram": hist, "files": files})
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


def test_digits_pass_and_the_reports_are_written(digits, tmp_path):
    cfg, prefix = digits
    summary = validate_shards(prefix, cfg, report_prefix=str(tmp_path / "validation"), docs=True)
    assert summary["success"] and summary["failed"] == 0 and summary["evaluated"] >= 40
    assert summary["report_uri"] == str(tmp_path / "validation" / "validation.json")
    assert summary["rows_per_s"] > 0 and summary["drift"]["skipped"] == "no previous validated manifest"
    report = json.loads(open(summary["report_uri"]).read())
    assert report["success"] and report["rows"] == 1797
    assert set(report["shards"]) == {"train-00000", "train-00001", "val", "test"}
    per_shard = report["shards"]["val"]
    assert per_shard["great_expectations"]["success"]
    assert per_shard["great_expectations"]["statistics"]["evaluated_expectations"] == 9
    assert {c["check"] for c in report["checks"]} >= {"train_shards_balanced", "train_shard_label_skew",
                                                      "all_shards_validated", "label_drift"}
    html = open(summary["html_uri"]).read()
    assert "Shard validation passed" in html and 'href="shards/val.html"' in html
    gx_page = open(tmp_path / "validation" / "shards" / "val.html").read()  # GX Data Docs rendering
    assert "Expectation Validation Result" in gx_page and "every feature is finite" in gx_page
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
    assert f"row 10: {shown}" in message and "2 unexpected in" in message
    assert {f["column_counts"]["pixel_5"] for f in info.value.failures} <= {1, 2}
    assert sum(f["unexpected_count"] for f in info.value.failures) == 2
    assert all(f["columns"] == ["pixel_5"] for f in info.value.failures)
    report = json.loads(open(tmp_path / "validation" / "validation.json").read())  # strict JSON despite NaN/inf
    assert report["success"] is False and report["failures"][0]["columns"] == ["pixel_5"]
    assert pickle.loads(pickle.dumps(info.value)).failures == info.value.failures


def test_labels_outside_the_declared_set_fail_with_their_values(tmp_path):
    def edit(frame: pd.DataFrame) -> None:
        frame["label"] = frame["label"].map(lambda k: f"digit-{k}")
        frame.loc[[3, 50], "label"] = "smudge"

    declared = tuple(f"digit-{k}" for k in range(10))
    cfg, prefix = shard_bad_source(tmp_path, edit, classes=declared)
    with pytest.raises(DataValidationError, match=r"labels are within the declared label set\]: 2 unexpected "
                                                  r"in .*e\.g\. \['smudge', 'smudge'\]") as info:
        validate_shards(prefix, cfg)
    assert {f["expectation"] for f in info.value.failures} == {"expect_column_values_to_be_in_set"}


def test_hand_written_bad_labels_fail(tmp_path):
    rng = np.random.default_rng(0)
    X, y = rows(40, rng)
    y[3] = 7
    write_manual_shards(str(tmp_path), [("train-00000", "train", X[:20], y[:20]), ("train-00001", "train", X[20:30], y[20:30]),
                                        ("val", "val", X[30:35], y[30:35]), ("test", "test", X[35:], y[35:])], num_classes=3)
    with pytest.raises(DataValidationError, match=r"labels are within the declared label set\]: 1 unexpected in 1 "
                                                  r"shard\(s\) \(train-00000: 1 of 20\); e\.g\. \[7\]"):
        validate_shards(str(tmp_path), config())


@pytest.mark.parametrize("sizes, match", [
    ((30, 5), r"train_shards_balanced: 1 train shard\(s\) hold more than 26\.2 rows"),
    ((30, 0), r"expect_table_row_count_to_be_between \[the shard holds rows\]: .*train-00001"),
])
def test_unbalanced_or_empty_train_shards_fail(sizes, match, tmp_path):
    rng = np.random.default_rng(1)
    (X0, y0), (X1, y1), (Xv, yv) = rows(sizes[0], rng), rows(sizes[1], rng), rows(6, rng)
    write_manual_shards(str(tmp_path), [("train-00000", "train", X0, y0), ("train-00001", "train", X1, y1),
                                        ("val", "val", Xv[:3], yv[:3]), ("test", "test", Xv[3:], yv[3:])], num_classes=3)
    with pytest.raises(DataValidationError, match=match):
        validate_shards(str(tmp_path), config())


def test_a_shard_with_a_skewed_label_mix_fails(tmp_path):
    rng = np.random.default_rng(2)
    X = rng.random((200, 4), dtype=np.float32)
    y0 = np.array([0] * 90 + [1] * 10)  # 90% class 0
    y1 = np.array([0] * 10 + [1] * 90)  # 90% class 1; together the train split is 50/50
    write_manual_shards(str(tmp_path), [("train-00000", "train", X[:100], y0), ("train-00001", "train", X[100:], y1),
                                        ("val", "val", X[:4], np.array([0, 1, 0, 1])),
                                        ("test", "test", X[4:8], np.array([0, 1, 0, 1]))], num_classes=2)
    with pytest.raises(DataValidationError, match=r"train_shard_label_skew: 2 train shard\(s\) have a label mix far "
                                                  r"from the train split's .*train-00000 \(0\.40\)"):
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
    assert "skipped" in report["shards"]["train-00001"]["great_expectations"]


def test_duplicate_ids_fail_across_shards(tmp_path):
    def edit(frame: pd.DataFrame) -> None:
        frame["uid"] = [f"id-{i}" for i in range(len(frame))]
        frame.loc[1500, "uid"] = "id-7"
        frame.loc[1600, "uid"] = "id-7"

    cfg, prefix = shard_bad_source(tmp_path, edit, id_column="uid")
    with pytest.raises(DataValidationError, match=r"1 ids of column 'uid' appear more than once \(2 extra rows\) "
                                                  r"across shards, e\.g\. \['source rows \[7, 1500, 1600\]'\]"):
        validate_shards(prefix, cfg)


def test_features_outside_the_declared_range_fail(tmp_path):
    def edit(frame: pd.DataFrame) -> None:
        frame.loc[12, "pixel_9"] = 99.0

    cfg, prefix = shard_bad_source(tmp_path, edit, feature_range=(0.0, 16.0))
    with pytest.raises(DataValidationError, match=r"every feature is within \[0\.0, 16\.0\]\]: 1 unexpected .*"
                                                  r"columns pixel_9 \(1\); e\.g\. \['row 12: pixel_9=99\.0'\]"):
        validate_shards(prefix, cfg)


@pytest.mark.parametrize("action", ["warn", "fail", "off"])
def test_label_drift_against_the_previous_manifest(digits, tmp_path, action):
    cfg, previous = digits

    def edit(frame: pd.DataFrame) -> None:  # keep only 20% of the rows of classes 0-4
        drop = frame.index[(frame["label"] < 5) & (frame.index % 5 != 0)]
        frame.drop(drop, inplace=True)

    cfg, prefix = shard_bad_source(tmp_path, edit, drift_action=action)
    if action == "fail":
        with pytest.raises(DataValidationError, match=r"label_drift: label distribution moved by 0\.3\d\d "
                                                      r"\(total variation distance, limit 0\.1\) since .*class "):
            validate_shards(prefix, cfg, previous_manifest_uri=previous)
        return
    summary = validate_shards(prefix, cfg, previous_manifest_uri=previous)
    assert summary["success"]
    if action == "warn":
        assert summary["drift"]["distance"] > 0.3 and any("label distribution moved" in w for w in summary["warnings"])
    else:
        assert summary["drift"]["skipped"] == "data.drift_action is 'off'" and summary["warnings"] == []
    same = validate_shards(previous, cfg.replace(data={"drift_action": "fail"}), previous_manifest_uri=previous)
    assert same["drift"]["distance"] == 0.0


def test_per_shard_outcomes_through_storage_then_the_cross_checks(digits, tmp_path):
    """The Airflow path: one call per shard (mapped tasks), results in storage, then one final call."""
    cfg, prefix = digits
    report_prefix = str(tmp_path / "validation")
    names = ["train-00000", "train-00001", "val", "test"]
    for name in names[:-1]:  # the "test" shard's task never finished
        outcome = validate_shard(prefix, name, cfg, docs=False)
        assert outcome.result["success"] and outcome.result["rows_per_s"] > 0
        save_outcome(outcome, report_prefix)
    outcomes = {name: load_outcome(report_prefix, name) for name in names}
    assert outcomes["test"] is None and outcomes["val"].result["rows"] > 0
    with pytest.raises(DataValidationError, match=r"all_shards_validated: 1 shard\(s\) have no validation result"):
        finish_validation(prefix, cfg, outcomes, report_prefix=report_prefix)
    save_outcome(validate_shard(prefix, "test", cfg), report_prefix)
    summary = finish_validation(prefix, cfg, {n: load_outcome(report_prefix, n) for n in names},
                                report_prefix=report_prefix)
    assert summary["success"] and json.loads(open(summary["report_uri"]).read())["success"]
