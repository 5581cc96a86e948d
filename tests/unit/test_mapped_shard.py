"""Mapped sharding (``data_checks.parts``): the shards and the manifest are byte-identical for 1,
2 and 3 parts, and identical to the one-pass sharder's, on a multi-file table, on one CSV file cut
by byte ranges, on a regression table with standardisation, and on a table with missing values
imputed (local paths; seconds)."""
from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pytest

from common import storage
from common.config import TrainConfig
from data_checks import DataError
from data_checks.assign import Assigner, SplitBlock, TRAIN
from data_checks.parts import PARTS_DIR, plan, shard_in_parts
from data_checks.preprocess import add_moments, exact_moments, mean_std
from data_checks.shard import shard_content_addressed

pytestmark = pytest.mark.unit

# What differs between two runs of the same sharding: when, and how fast.
VOLATILE = ("created_at",)
VOLATILE_STATS = ("seconds", "source_mb_per_s")


def table(rows: int = 1200, seed: int = 3) -> pd.DataFrame:
    """Classes of every size (a class of 1 row, of 2, of 4, the rest large), a text column, an id."""
    rng = np.random.default_rng(seed)
    label = rng.choice(["a", "b", "c", 7, 8], rows).astype(object)
    label[[5, 700]] = "pair"  # 2 rows: all train, dealt last
    label[[1100]] = "single"
    label[[10, 400, 650, 1190]] = "four"  # its first two rows and its third fall in different parts
    frame = pd.DataFrame({"uid": [f"r{i}" for i in range(rows)], "label": label,
                          "x": rng.normal(3, 2, rows).astype(np.float32),
                          "y": rng.exponential(5, rows).astype(np.float32),
                          "colour": rng.choice(["red", "green", "blue", "cyan"], rows)})
    frame.loc[rng.choice(rows, 40, replace=False), "x"] = np.nan
    return frame


def config(source: str, **data: object) -> TrainConfig:
    return TrainConfig.from_dict({"data": {"source_uri": source, "label_column": "label", "id_column": "uid",
                                           "chunk_rows": 97, "num_shards": 3, **data},
                                  "cluster": {"num_workers": 3}})


def regression(source: str, **data: object) -> TrainConfig:
    return TrainConfig.from_dict({"data": {"source_uri": source, "label_column": "t", "chunk_rows": 61,
                                           "num_shards": 2, "standardize": True, **data},
                                  "model": {"task": "regression"}, "cluster": {"num_workers": 2}})


def everything(prefix: str, manifest: dict) -> tuple[dict, dict]:
    """The manifest without its date and timings, and every shard file's bytes."""
    same = {k: v for k, v in manifest.items() if k not in VOLATILE}
    same["stats"] = {k: v for k, v in manifest["stats"].items() if k not in VOLATILE_STATS}
    files = {}
    for shard in manifest["shards"]:
        for meta in shard["files"].values():
            files[meta["name"]] = storage.get_bytes(storage.join(prefix, meta["name"]))
    return same, files


def check_identical(cfg: TrainConfig, root: str, parts: tuple[int, ...] = (1, 2, 3)) -> dict:
    one_pass_prefix, one_pass, _ = shard_content_addressed(cfg, os.path.join(root, "one-pass"))
    expected = everything(one_pass_prefix, one_pass)
    for n in parts:
        prefix, manifest, reused = shard_in_parts(cfg, os.path.join(root, f"parts-{n}"), n)
        assert not reused
        got = everything(prefix, manifest)
        assert got[0] == expected[0], f"{n} parts: the manifest differs"
        assert got[1].keys() == expected[1].keys()
        for name in expected[1]:
            assert got[1][name] == expected[1][name], f"{n} parts: {name} differs"
        assert not os.path.exists(os.path.join(prefix, PARTS_DIR)) or not os.listdir(os.path.join(prefix, PARTS_DIR))
    return one_pass


@pytest.fixture(scope="module")
def frame() -> pd.DataFrame:
    return table()


def test_a_multi_file_table_is_byte_identical_in_1_2_3_parts(frame, tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    for i, cut in enumerate(np.array_split(np.arange(len(frame)), 4)):  # files of unequal sizes on purpose
        frame.iloc[cut[: len(cut) - 20 * i]].to_csv(folder / f"part-{i}.csv", index=False)
    cfg = config(str(folder) + "/", missing_values="impute")
    manifest = check_identical(cfg, str(tmp_path / "out"))
    assert manifest["source"]["num_files"] == 4 and manifest["preprocessing"]["imputed"]
    assert {"pair", "single", "four"} <= set(manifest["classes"])


def test_one_csv_cut_by_byte_ranges_is_byte_identical(frame, tmp_path):
    path = tmp_path / "one.csv"
    frame.to_csv(path, index=False)
    check_identical(config(str(path), missing_values="impute"), str(tmp_path / "out"), parts=(1, 2, 3, 7))


def test_one_parquet_file_is_one_part(frame, tmp_path):
    path = tmp_path / "one.parquet"
    frame.to_parquet(path, index=False)
    planned = plan(config(str(path), missing_values="impute"), str(tmp_path / "out"), 3)
    assert planned["parts"] == [0]


def test_regression_with_standardize_is_byte_identical(tmp_path):
    rng = np.random.default_rng(5)
    n = 700
    frame = pd.DataFrame({"a": rng.normal(0, 1e4, n), "b": rng.uniform(-1, 1, n) * 1e-3})
    frame["t"] = 3 * frame["a"] + rng.normal(0, 1, n)
    path = tmp_path / "reg.csv"
    frame.to_csv(path, index=False)
    manifest = check_identical(regression(str(path)), str(tmp_path / "out"))
    assert manifest["preprocessing"]["targets"][0]["name"] == "t"


def test_reuse_on_unchanged_data_and_a_new_prefix_on_changed_data(frame, tmp_path):
    path = tmp_path / "one.csv"
    frame.to_csv(path, index=False)
    cfg = config(str(path))
    prefix, manifest, reused = shard_in_parts(cfg, str(tmp_path / "out"), 2)
    again, same, reused_again = shard_in_parts(cfg, str(tmp_path / "out"), 3)
    assert not reused and reused_again and again == prefix and same == manifest
    frame.iloc[:-1].to_csv(path, index=False)
    changed, _, reused_changed = shard_in_parts(cfg, str(tmp_path / "out"), 2)
    assert not reused_changed and changed != prefix


def test_a_missing_label_column_fails_at_plan_time(frame, tmp_path):
    path = tmp_path / "one.csv"
    frame.to_csv(path, index=False)
    with pytest.raises(DataError, match="label column 'digit' not found"):
        plan(config(str(path), label_column="digit"), str(tmp_path / "out"), 2)


def test_train_rows_counts_without_the_rows():
    block = SplitBlock.from_fractions(0.1, 0.2)
    assigner = Assigner(block, 3, 7)
    assigner.add_class(0, "x")
    splits = assigner._split_of(np.zeros(2500, np.int64), np.arange(2500))
    splits[:block.size] = assigner._first_block_of(0)
    rng = np.random.default_rng(0)
    for a, b in [sorted(rng.integers(0, 2500, 2)) for _ in range(200)] + [(0, 2500), (3, 10), (10, 20)]:
        assert assigner.train_rows(0, a, b) == int((splits[a:b] == TRAIN).sum()), (a, b)


def test_exact_moments_merge_in_any_order():
    from fractions import Fraction

    rng = np.random.default_rng(1)
    x = (rng.standard_normal(5000) * 1e3).astype(np.float32)
    x[:4] = [1e-45, -3e38, 3e38, 0.0]
    n, s, q, bad = exact_moments(np.r_[x, np.float32("nan")])
    assert bad == 1
    assert Fraction(s, 1 << 172) == sum(Fraction(float(v)) for v in x)
    assert Fraction(q, 1 << 344) == sum(Fraction(float(v)) ** 2 for v in x)
    parts = np.split(rng.permutation(x), [7, 1000, 3000])
    total = (0, 0, 0, 1)
    for p in parts[::-1]:
        total = add_moments(total, exact_moments(p))
    assert total == (n, s, q, 1) and mean_std((n, s, q, 0)) == mean_std(add_moments(total, (0, 0, 0, -1)))
    json.dumps(total)  # plain ints: they travel as JSON


def test_a_merge_run_again_after_its_commit_returns_the_manifest(frame, tmp_path):
    """A retry of the merge task after it committed (e.g. lost while removing the parts' folder)."""
    from data_checks.parts import count, merge, shard_part

    path = tmp_path / "one.csv"
    frame.to_csv(path, index=False)
    cfg = config(str(path))
    planned = plan(cfg, str(tmp_path / "out"), 2)
    for k in planned["parts"]:
        count(cfg, planned["plan_uri"], k)
    for k in planned["parts"]:
        shard_part(cfg, planned["plan_uri"], k)
    first = merge(cfg, planned["plan_uri"])
    assert not storage.exists(planned["plan_uri"])  # the parts' folder is gone after the commit
    plan_doc = {"prefix": planned["prefix"], "fingerprint": planned["fingerprint"],
                "work": planned["plan_uri"].rsplit("/", 1)[0]}
    storage.put_bytes(planned["plan_uri"], json.dumps(plan_doc).encode())  # as if the removal had failed
    assert merge(cfg, planned["plan_uri"]) == first
    assert not storage.exists(planned["plan_uri"])
