"""Sharding a source table into RecordIO shards + manifest (local paths; no servers)."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import tracemalloc

# Before anything imports mxnet: common.record_codec keeps mxnet from importing scikit-learn by
# blocking the name, which would also block load_digits if it came later.
from sklearn.datasets import load_digits  # noqa: F401

import numpy as np
import pandas as pd
import pytest

from common import record_codec, storage
from data_checks import DataError
from data_checks.assign import SplitBlock, expected_bounds
from common.manifest import download_shard, load_manifest, manifest_digest
from data_checks.shard import shard_content_addressed, shard_dataset
from common.config import ClusterConfig, DataConfig, TrainConfig
from testkit.digits import digits_frame

pytestmark = pytest.mark.unit

N_DIGITS = 1797


def config(source: str, workers: int = 2, **data: object) -> TrainConfig:
    # One shard feeds one worker only (the config refuses fewer train shards than workers).
    # These tests compare shard bytes with the source: no standardisation (test_preprocess.py).
    data.setdefault("standardize", False)
    return TrainConfig(cluster=ClusterConfig(num_workers=workers),
                       data=DataConfig(source_uri=source, label_column="label", **data))


def shas(manifest: dict) -> dict:
    return {s["name"]: (s["files"]["rec"]["sha256"], s["files"]["idx"]["sha256"]) for s in manifest["shards"]}


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
        out[shard["name"]] = record_codec.read_all(idx, rec, manifest["num_features"])
    return out


def test_shards_are_readable_by_mxnet_and_read_all(sharded, tmp_path):
    import mxnet as mx

    cfg, prefix, manifest = sharded
    source = digits_frame()
    assert [s["name"] for s in manifest["shards"]] == ["train-00000", "train-00001", "train-00002", "val", "test"]
    assert manifest["num_features"] == 64 and manifest["feature_columns"][:2] == ["pixel_0", "pixel_1"]
    assert manifest["classes"] == list(range(10)) and manifest["num_classes"] == 10
    assert manifest == load_manifest(prefix) and len(manifest_digest(manifest)) == 64
    assert manifest["schema"]["feature_dtype"] == "float32" and manifest["source_kind"] == "table"
    assert manifest["source"]["files"][0]["sha256"] == storage.sha256_file(cfg.data.source_uri)
    assert manifest["sharding"]["num_train_shards"] == 3 and manifest["stats"]["rows"] == N_DIGITS

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

    labels = digits_frame()["label"].to_numpy()
    block = SplitBlock.from_fractions(cfg.data.val_fraction, cfg.data.test_fraction)
    for k in range(10):  # the documented per-class bounds
        n = int((labels == k).sum())
        bounds = expected_bounds(n, block)
        for split in ("val", "test"):
            got = manifest["splits"][split]["label_histogram"][str(k)]
            assert bounds[split][0] <= got <= bounds[split][1], (k, split, got, bounds)
    for shard in manifest["shards"]:
        _, y, _ = loaded[shard["name"]]
        assert shard["count"] == len(y)
        assert shard["label_histogram"] == {str(k): int(c) for k, c in zip(*np.unique(y, return_counts=True))}
    counts = {s: manifest["splits"][s]["count"] for s in ("train", "val", "test")}
    assert sum(counts.values()) == N_DIGITS
    assert abs(counts["test"] / N_DIGITS - cfg.data.test_fraction) < 0.015
    assert abs(counts["val"] / N_DIGITS - cfg.data.val_fraction) < 0.015
    train_counts = [s["count"] for s in manifest["shards"] if s["split"] == "train"]
    assert len(train_counts) == 3 and max(train_counts) - min(train_counts) <= 1


def test_deterministic_for_any_chunk_size_idempotent_and_resharded_on_change(sharded, tmp_path):
    cfg, prefix, manifest = sharded
    again = shard_dataset(cfg.replace(data={"chunk_rows": 37}), str(tmp_path / "again"))
    assert shas(again) == shas(manifest)  # chunking does not change a byte

    manifest_path = os.path.join(prefix, "manifest.json")
    before = (os.path.getmtime(manifest_path), open(manifest_path, "rb").read())
    assert shard_dataset(cfg, prefix) == manifest  # same source + settings: reused, not rewritten
    assert (os.path.getmtime(manifest_path), open(manifest_path, "rb").read()) == before

    resharded = shard_dataset(cfg.replace(seed=7), str(tmp_path / "again"))
    assert resharded["seed"] == 7 and load_manifest(str(tmp_path / "again")) == resharded
    assert shas(resharded)["train-00000"] != shas(manifest)["train-00000"]


def test_content_addressed_prefix_follows_the_source(digits_csv, tmp_path):
    source = str(tmp_path / "d.csv")
    shutil.copy(digits_csv, source)
    cfg = config(source)
    prefix, manifest, reused = shard_content_addressed(cfg, str(tmp_path / "shards"))
    assert not reused and prefix == str(tmp_path / "shards" / manifest["source_fingerprint"][:16])
    assert shard_content_addressed(cfg, str(tmp_path / "shards")) == (prefix, manifest, True)
    frame = digits_frame()
    frame.loc[0, "pixel_3"] = 5.0
    frame.to_csv(source, index=False)
    changed, changed_manifest, reused = shard_content_addressed(cfg, str(tmp_path / "shards"))
    assert not reused and changed != prefix and changed_manifest["source_sha256"] != manifest["source_sha256"]
    other_settings = shard_content_addressed(cfg.replace(data={"test_fraction": 0.3}), str(tmp_path / "shards"))
    assert other_settings[0] not in (prefix, changed)
    assert os.path.exists(os.path.join(prefix, "manifest.json"))  # older shards stay for older runs


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


def _bad_source(case: str, tmp_path) -> str:
    """Write the source of one bad-input case; returns its URI."""
    frames = {
        "header_only": pd.DataFrame({"a": [], "label": []}),
        "no_label": pd.DataFrame({"a": [1, 2], "b": [3, 4]}),
        # text columns are categorical; a date is neither a number nor text
        "non_numeric": pd.DataFrame({"a": [1.0, 2.0, 3.0], "day": ["2024-01-01", "2024-01-02", "2024-01-03"],
                                     "label": [0, 1, 0]}),
        "tiny_classes": pd.DataFrame({"a": [1.0, 2.0, 3.0, 4.0], "label": [0, 0, 1, 1]}),
        "one_class": pd.DataFrame({"a": [1.0, 2.0, 3.0], "label": [5, 5, 5]}),
    }
    path = tmp_path / f"{case}.csv"
    if case in frames:
        frames[case].to_csv(path, index=False)
    elif case == "zero_bytes":
        path.write_bytes(b"")
    elif case == "unknown_ext":
        path = tmp_path / "data.json"
        path.write_text("{}")
    elif case == "late_string":  # numeric past the first megabyte (where types are sniffed), then a string
        frame = pd.DataFrame({"a": np.arange(200_000, dtype=float) + 0.5, "label": np.arange(200_000) % 3})
        frame["a"] = frame["a"].astype(object)
        frame.loc[199_000, "a"] = "oops"
        frame.to_csv(path, index=False)
    elif case == "latin1":
        path.write_bytes("a,label\n1.0,chat\n2.0,caf\u00e9\n3.0,chat\n".encode("latin-1"))
    elif case == "truncated_gzip":
        path = tmp_path / "truncated.csv.gz"
        data = gzip.compress(digits_frame().to_csv(index=False).encode())
        path.write_bytes(data[: len(data) // 2])
    elif case == "not_gzip":
        path = tmp_path / "plain.csv.gz"
        path.write_bytes(b"a,label\n1,2\n" * 10)
    elif case == "truncated_parquet":
        path = tmp_path / "truncated.parquet"
        digits_frame().to_parquet(path)
        path.write_bytes(path.read_bytes()[:-100])
    elif case == "ragged":
        path.write_text("a,b,label\n1,2,0\n3,4,5,6\n")
    else:
        path = tmp_path / "nope.csv"
    return str(path)


@pytest.mark.parametrize("case, match", [
    ("missing", r"source dataset not found: .*nope\.csv"),
    ("header_only", r"no rows \(header only\): .*header_only\.csv"),
    ("no_label", r"label column 'label' not found in .*no_label\.csv; available columns: \['a', 'b'\]"),
    ("non_numeric", r"feature columns in .*non_numeric\.csv are neither numbers nor text: 'day' \(date32\[day\]"),
    ("late_string", r"non-numeric value in .*late_string\.csv: column 'a':.*invalid value 'oops'"),
    ("latin1", r"latin1\.csv is not UTF-8 text: column 'label':.*re-encode the file as UTF-8"),
    ("zero_bytes", r"source dataset is empty .*zero_bytes\.csv"),
    ("truncated_gzip", r"truncated\.csv\.gz is a truncated or corrupt gzip file"),
    ("not_gzip", r"plain\.csv\.gz is not a valid gzip file"),
    ("truncated_parquet", r"cannot read .*truncated\.parquet as Parquet \(truncated or corrupt\?\)"),
    ("ragged", r"cannot parse .*ragged\.csv as CSV: .*Expected 3 columns, got 4"),
    ("tiny_classes", r"too few rows per class"),
    ("one_class", r"single class"),
    ("unknown_ext", r"unsupported source format for .*data\.json"),
])
def test_bad_input_is_a_data_error(case, match, tmp_path):
    source = _bad_source(case, tmp_path)
    with pytest.raises(DataError, match=match):
        shard_dataset(config(source), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out" / "manifest.json")


@pytest.mark.parametrize("data, match", [
    ({"feature_columns": ("pixel_0", "pixel_99")}, r"declared feature columns \['pixel_99'\] .* not found"),
    ({"id_column": "uid"}, r"id column 'uid' \(data\.id_column\) not found"),
])
def test_declared_columns_must_exist(digits_csv, tmp_path, data, match):
    with pytest.raises(DataError, match=match):
        shard_dataset(config(digits_csv, **data), str(tmp_path / "out"))


def test_files_must_share_their_columns(tmp_path):
    (tmp_path / "parts").mkdir()
    pd.DataFrame({"a": [1.0] * 9, "label": [0, 1, 2] * 3}).to_csv(tmp_path / "parts" / "p1.csv", index=False)
    pd.DataFrame({"b": [1.0] * 9, "label": [0, 1, 2] * 3}).to_csv(tmp_path / "parts" / "p2.csv", index=False)
    with pytest.raises(DataError, match=r"columns of .*p2\.csv differ from the first file .*p1\.csv: missing "
                                        r"\['a'\], extra \['b'\]"):
        shard_dataset(config(str(tmp_path / "parts") + "/"), str(tmp_path / "out"))


def test_many_files_shard_like_one(sharded, tmp_path):
    """A folder, a glob or a Parquet split of the same rows give the very same shards."""
    cfg, _, manifest = sharded
    frame = digits_frame()
    (tmp_path / "csv").mkdir()
    (tmp_path / "pq").mkdir()
    for i, part in enumerate(np.array_split(np.arange(N_DIGITS), 4)):
        frame.iloc[part].to_csv(tmp_path / "csv" / f"part-{i}.csv", index=False)
        frame.iloc[part].to_parquet(tmp_path / "pq" / f"part-{i}.parquet", row_group_size=100)
    (tmp_path / "csv" / "README.txt").write_text("not data")
    for source in (str(tmp_path / "csv") + "/", str(tmp_path / "csv" / "part-*.csv"), str(tmp_path / "pq") + "/"):
        out = shard_dataset(cfg.replace(data={"source_uri": source}), str(tmp_path / "out" / str(hash(source))))
        assert shas(out) == shas(manifest), source
        assert out["source"]["num_files"] == 4


def test_formats_small_classes_and_string_labels(tmp_path):
    # 4 classes; "rare" has 2 rows, too few for a 3-way split, so both rows go to train.
    frame = pd.DataFrame({
        "x": np.arange(26, dtype=float), "flag": [True, False] * 13,
        "label": ["eel"] * 8 + ["dog"] * 8 + ["cat"] * 8 + ["rare"] * 2,
    })
    results = []
    for name in ("t.parquet", "t.pq", "t.csv.gz", "t.csv"):
        uri = str(tmp_path / name)
        (frame.to_parquet if "parquet" in name or name.endswith(".pq") else frame.to_csv)(uri, index=False)
        results.append(shard_dataset(config(uri, num_shards=2), str(tmp_path / f"out-{name}")))
    assert len({json.dumps(shas(m)) for m in results}) == 1  # the same shards from every format
    manifest = results[0]
    assert manifest["classes"] == ["cat", "dog", "eel", "rare"]  # sorted, though "eel" came first
    assert manifest["feature_columns"] == ["x", "flag"]
    hist = {s["name"]: s["label_histogram"] for s in manifest["shards"]}
    assert "3" not in hist["val"] and "3" not in hist["test"]
    assert sum(h.get("3", 0) for n, h in hist.items() if n.startswith("train")) == 2
    assert all(set(hist[s]) == {"0", "1", "2"} for s in ("val", "test"))
    assert json.loads(open(tmp_path / "out-t.parquet" / "manifest.json").read()) == manifest
    X, y, ids = record_codec.read_all(*download_shard(manifest, str(tmp_path / "out-t.parquet"), "val", str(tmp_path)), 2)
    names = np.array(manifest["classes"])[y]
    np.testing.assert_array_equal(names, frame["label"].to_numpy()[ids])  # labels remapped to sorted order


def test_declared_classes_order_and_id_column(tmp_path):
    frame = pd.DataFrame({"uid": [f"u{i}" for i in range(30)], "x": np.arange(30.0),
                          "label": ["b", "a", "c"] * 9 + ["zebra"] * 3})
    frame.to_csv(tmp_path / "t.csv", index=False)
    cfg = config(str(tmp_path / "t.csv"), id_column="uid", classes=("c", "b", "a"), num_shards=1, workers=1)
    manifest = shard_dataset(cfg, str(tmp_path / "out"))
    # Declared order first; a value outside the declared set is kept, after them, for validation to flag.
    assert manifest["classes"] == ["c", "b", "a", "zebra"] and manifest["declared_classes"] == ["c", "b", "a"]
    assert manifest["feature_columns"] == ["x"] and manifest["id_column"] == "uid"
    shard = record_codec.read_shard(*download_shard(manifest, str(tmp_path / "out"), "train-00000", str(tmp_path)), 1)
    assert len(set(shard.id_hashes.tolist())) == len(shard.id_hashes) and (shard.id_hashes != 0).all()
    from data_checks.readers import hash_ids

    np.testing.assert_array_equal(shard.id_hashes, hash_ids(frame["uid"].to_numpy()[shard.row_ids]))


def test_input_shape_must_match_the_features(digits_csv, tmp_path):
    with pytest.raises(DataError, match=r"input_shape \(1, 8, 9\) holds 72 values but .* has 64 feature"):
        shard_dataset(config(digits_csv, input_shape=(1, 8, 9)), str(tmp_path / "out"))


def test_memory_follows_the_chunk_not_the_dataset(tmp_path):
    """200k rows × 16 features (13 MB as float32, 34 MB of CSV) in chunks of 2000 rows: the
    Python-side peak (numpy arrays and the CSV blocks pyarrow reads ahead; tracemalloc sees
    both) stays well under the file size."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    rng = np.random.default_rng(0)
    columns = {f"f{i}": rng.random(200_000, dtype=np.float32) for i in range(16)}
    pcsv.write_csv(pa.table({**columns, "label": rng.integers(0, 5, 200_000)}), str(tmp_path / "big.csv"))
    assert os.path.getsize(tmp_path / "big.csv") > 30e6
    del columns
    tracemalloc.start()
    try:
        manifest = shard_dataset(config(str(tmp_path / "big.csv"), chunk_rows=2000), str(tmp_path / "out"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert manifest["stats"]["rows"] == 200_000
    assert peak < 16e6, f"peak {peak / 1e6:.1f} MB"
