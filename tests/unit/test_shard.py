"""Sharding a source table into RecordIO shards + manifest (local paths; no servers)."""
from __future__ import annotations

import json
import os

# Before anything imports mxnet: common.records keeps mxnet from importing scikit-learn by
# blocking the name, which would also block load_digits if it came later.
from sklearn.datasets import load_digits

import numpy as np
import pandas as pd
import pytest

from common import records, storage
from data_checks import DataError
from data_checks.shard import download_shard, load_manifest, manifest_digest, shard_dataset
from data_checks.sources import fingerprint, read_table
from training.config import DataConfig, TrainConfig

pytestmark = pytest.mark.unit

N_DIGITS = 1797


def digits_frame() -> pd.DataFrame:
    d = load_digits()
    df = pd.DataFrame(d.data, columns=[f"pixel_{i}" for i in range(64)])
    df["label"] = d.target
    return df


def config(source: str, **data: object) -> TrainConfig:
    return TrainConfig(data=DataConfig(source_uri=source, label_column="label", **data))


@pytest.fixture(scope="module")
def digits_csv(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("src") / "digits.csv")
    digits_frame().to_csv(path, index=False)
    return path


@pytest.fixture(scope="module")
def sharded(digits_csv: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, str, dict]:
    cfg = config(digits_csv, num_shards=3)
    prefix = str(tmp_path_factory.mktemp("shards") / "run")
    return cfg, prefix, shard_dataset(cfg, prefix)


def load_all(manifest: dict, prefix: str, local_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    out = {}
    for shard in manifest["shards"]:
        idx, rec = download_shard(manifest, prefix, shard["name"], local_dir)
        out[shard["name"]] = records.read_all(idx, rec, manifest["num_features"])
    return out


def test_shards_are_readable_by_mxnet_and_read_all(sharded, tmp_path):
    import mxnet as mx

    cfg, prefix, manifest = sharded
    source = digits_frame()
    assert [s["name"] for s in manifest["shards"]] == ["train-00000", "train-00001", "train-00002", "val", "test"]
    assert manifest["num_features"] == 64 and manifest["feature_columns"][:2] == ["pixel_0", "pixel_1"]
    assert manifest["classes"] == list(range(10)) and manifest["num_classes"] == 10
    assert manifest == load_manifest(prefix) and len(manifest_digest(manifest)) == 64

    idx, rec = download_shard(manifest, prefix, "val", str(tmp_path))
    rio = mx.recordio.MXIndexedRecordIO(idx, rec, "r")
    try:
        assert len(rio.keys) == manifest["shards"][3]["count"]
        header, payload = mx.recordio.unpack(rio.read_idx(rio.keys[0]))
    finally:
        rio.close()
    row = int(header.id)
    assert int(header.label) == source["label"][row]
    np.testing.assert_array_equal(np.frombuffer(payload, "<f4"), source.iloc[row, :64].to_numpy(np.float32))

    for name, (X, y, ids) in load_all(manifest, prefix, str(tmp_path)).items():
        assert X.dtype == np.float32 and X.shape == (len(ids), 64)
        np.testing.assert_array_equal(X, source.iloc[ids, :64].to_numpy(np.float32), err_msg=name)
        np.testing.assert_array_equal(y, source["label"].to_numpy()[ids], err_msg=name)


def test_every_row_once_stratified_and_balanced(sharded, tmp_path):
    cfg, prefix, manifest = sharded
    loaded = load_all(manifest, prefix, str(tmp_path))
    all_ids = np.concatenate([ids for _, _, ids in loaded.values()])
    assert sorted(all_ids.tolist()) == list(range(N_DIGITS))

    by_split: dict[str, set[int]] = {"train": set(), "val": set(), "test": set()}
    for shard in manifest["shards"]:
        _, y, _ = loaded[shard["name"]]
        by_split[shard["split"]] |= set(y.tolist())
        assert shard["count"] == len(y)
        assert shard["label_histogram"] == {str(k): int(c) for k, c in zip(*np.unique(y, return_counts=True))}
    assert all(labels == set(range(10)) for labels in by_split.values())

    counts = {s: manifest["splits"][s]["count"] for s in ("train", "val", "test")}
    assert sum(counts.values()) == N_DIGITS
    assert abs(counts["test"] / N_DIGITS - cfg.data.test_fraction) < 0.01
    assert abs(counts["val"] / N_DIGITS - cfg.data.val_fraction) < 0.01
    train_counts = [s["count"] for s in manifest["shards"] if s["split"] == "train"]
    assert len(train_counts) == 3 and max(train_counts) - min(train_counts) <= 1


def test_deterministic_idempotent_and_resharded_on_change(sharded, tmp_path):
    cfg, prefix, manifest = sharded

    def shas(m: dict) -> dict:
        return {s["name"]: (s["files"]["rec"]["sha256"], s["files"]["idx"]["sha256"]) for s in m["shards"]}

    again = shard_dataset(cfg, str(tmp_path / "again"))
    assert shas(again) == shas(manifest)

    manifest_path = os.path.join(prefix, "manifest.json")
    before = (os.path.getmtime(manifest_path), open(manifest_path, "rb").read())
    assert shard_dataset(cfg, prefix) == manifest  # same source + settings: reused, not rewritten
    assert (os.path.getmtime(manifest_path), open(manifest_path, "rb").read()) == before

    other = cfg.replace(seed=7)
    resharded = shard_dataset(other, str(tmp_path / "again"))
    assert resharded["seed"] == 7 and load_manifest(str(tmp_path / "again")) == resharded
    assert shas(resharded)["train-00000"] != shas(manifest)["train-00000"]


def test_manifest_is_written_last(digits_csv, tmp_path, monkeypatch):
    prefix = str(tmp_path / "crash")
    real_upload = storage.upload_file
    calls = []

    def flaky_upload(local_path: str, uri: str) -> None:
        calls.append(uri)
        if len(calls) == 3:
            raise OSError("simulated crash during upload")
        real_upload(local_path, uri)

    monkeypatch.setattr(storage, "upload_file", flaky_upload)
    with pytest.raises(OSError, match="simulated crash"):
        shard_dataset(config(digits_csv), prefix)
    assert not os.path.exists(os.path.join(prefix, "manifest.json"))
    with pytest.raises(DataError, match="no shard manifest"):
        load_manifest(prefix)

    monkeypatch.setattr(storage, "upload_file", real_upload)
    manifest = shard_dataset(config(digits_csv), prefix)
    assert load_manifest(prefix) == manifest


@pytest.mark.parametrize("case, match", [
    ("missing", r"source dataset not found: .*nope\.csv"),
    ("header_only", r"no rows \(header only\): .*header_only\.csv"),
    ("no_label", r"label column 'label' not found in .*no_label\.csv; available columns: \['a', 'b'\]"),
    ("non_numeric", r"non-numeric feature columns in .*non_numeric\.csv: 'color' \(object, e\.g\. 'red'\)"),
    ("zero_bytes", r"source dataset is empty .*zero_bytes\.csv"),
    ("tiny_classes", r"too few rows per class"),
    ("one_class", r"single class"),
    ("unknown_ext", r"unsupported source format for .*data\.json"),
])
def test_bad_input_is_a_data_error(case, match, tmp_path):
    frames = {
        "header_only": pd.DataFrame({"a": [], "label": []}),
        "no_label": pd.DataFrame({"a": [1, 2], "b": [3, 4]}),
        "non_numeric": pd.DataFrame({"a": [1.0, 2.0, 3.0], "color": [1, "red", "blue"], "label": [0, 1, 0]}),
        "tiny_classes": pd.DataFrame({"a": [1.0, 2.0, 3.0, 4.0], "label": [0, 0, 1, 1]}),
        "one_class": pd.DataFrame({"a": [1.0, 2.0, 3.0], "label": [5, 5, 5]}),
    }
    if case in frames:
        source = str(tmp_path / f"{case}.csv")
        frames[case].to_csv(source, index=False)
    elif case == "zero_bytes":
        source = str(tmp_path / "zero_bytes.csv")
        open(source, "wb").close()
    elif case == "unknown_ext":
        source = str(tmp_path / "data.json")
        open(source, "w").write("{}")
    else:
        source = str(tmp_path / "nope.csv")
    with pytest.raises(DataError, match=match):
        shard_dataset(config(source), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


def test_sources_formats_small_classes_and_string_labels(tmp_path):
    # 4 classes; "rare" has 2 rows, too few for a 3-way split, so both rows go to train.
    frame = pd.DataFrame({
        "x": np.arange(26, dtype=float), "flag": [True, False] * 13,
        "label": ["cat"] * 8 + ["dog"] * 8 + ["eel"] * 8 + ["rare"] * 2,
    })
    for name in ("t.parquet", "t.pq", "t.csv.gz"):
        uri = str(tmp_path / name)
        (frame.to_parquet if "parquet" in name or name.endswith(".pq") else frame.to_csv)(uri, index=False)
        pd.testing.assert_frame_equal(read_table(uri), frame)
        assert fingerprint(uri) == storage.sha256_file(uri)

    cfg = config(str(tmp_path / "t.parquet"), num_shards=2)
    manifest = shard_dataset(cfg, str(tmp_path / "out"))
    assert manifest["classes"] == ["cat", "dog", "eel", "rare"]
    assert manifest["feature_columns"] == ["x", "flag"]
    hist = {s["name"]: s["label_histogram"] for s in manifest["shards"]}
    assert "3" not in hist["val"] and "3" not in hist["test"]
    assert sum(h.get("3", 0) for n, h in hist.items() if n.startswith("train")) == 2
    assert all(set(hist[s]) == {"0", "1", "2"} for s in ("val", "test"))
    assert json.loads(open(tmp_path / "out" / "manifest.json").read()) == manifest


def test_input_shape_must_match_the_features(digits_csv, tmp_path):
    with pytest.raises(DataError, match=r"input_shape \(1, 8, 9\) holds 72 values but .* has 64 feature"):
        shard_dataset(config(digits_csv, input_shape=(1, 8, 9)), str(tmp_path / "out"))
