"""Table preprocessing: fitted on the train split only, recorded in the manifest, part of the
shard cache key, applied alike by the sharder and the served model (local paths; no servers)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from common import record_codec
from common.config import ClusterConfig, DataConfig, TrainConfig
from training.tracking.evaluation import raw_frame
from data_checks import DataValidationError
from common.manifest import download_shard
from data_checks.shard import shard_content_addressed, shard_dataset
from data_checks.validate import validate_shards
from training.tracking.pyfunc_model import raw_features

pytestmark = pytest.mark.unit

N = 600


def table(seed: int = 0) -> pd.DataFrame:
    """Columns on very different scales, a text column, missing values in both kinds."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame({"small": rng.normal(0.01, 0.002, N), "big": rng.normal(5e4, 1e3, N),
                          "colour": rng.choice(["red", "green", "blue"], N), "label": rng.integers(0, 3, N)})
    frame.loc[::13, "big"] = np.nan
    frame.loc[::29, "colour"] = None
    return frame


def config(source: str, **data: object) -> TrainConfig:
    return TrainConfig(cluster=ClusterConfig(num_workers=2), data=DataConfig(source_uri=source, **data))


def split_rows(manifest: dict, prefix: str, tmp) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per split: the shard features and their source row numbers."""
    out: dict[str, list] = {}
    for shard in manifest["shards"]:
        X, _, ids = record_codec.read_all(*download_shard(manifest, prefix, shard["name"], str(tmp)),
                                     manifest["num_features"])
        out.setdefault(shard["split"], []).append((X, ids))
    return {k: (np.concatenate([p[0] for p in v]), np.concatenate([p[1] for p in v])) for k, v in out.items()}


@pytest.fixture(scope="module")
def imputed(tmp_path_factory: pytest.TempPathFactory) -> tuple[pd.DataFrame, TrainConfig, str, dict]:
    root = tmp_path_factory.mktemp("prep")
    frame = table()
    frame.to_csv(root / "t.csv", index=False)
    cfg = config(str(root / "t.csv"), missing_values="impute")
    return frame, cfg, str(root / "shards"), shard_dataset(cfg, str(root / "shards"))


def test_the_record_holds_the_train_splits_statistics(imputed, tmp_path):
    frame, _, prefix, manifest = imputed
    prep = manifest["preprocessing"]
    train_ids = split_rows(manifest, prefix, tmp_path)["train"][1]
    train = frame.iloc[np.sort(train_ids)]
    small, big, colour = prep["inputs"]
    values = train["big"].dropna().to_numpy(np.float32).astype(np.float64)
    assert big["mean"] == pytest.approx(values.mean(), rel=1e-9) and big["std"] == pytest.approx(values.std(), rel=1e-9)
    assert big["fill"] == np.median(values)
    assert colour["categories"] == ["blue", "green", "red"] and colour["fill"] == train["colour"].mode()[0]
    assert small["fill"] is not None and prep["fit_on"] == "train" and prep["rows"] == len(train_ids)
    assert manifest["feature_columns"] == ["small", "big", "colour=blue", "colour=green", "colour=red",
                                           "colour=<unknown>"] == prep["output_columns"]
    assert manifest["num_features"] == 6 and manifest["schema"]["categorical_columns"] == ["colour"]
    # every missing value is counted where it was imputed
    rows = split_rows(manifest, prefix, tmp_path)
    for split, (_, ids) in rows.items():
        part = frame.iloc[ids]
        assert prep["imputed"][split] == {k: int(v) for k, v in part[["big", "colour"]].isna().sum().items() if v}
    X = rows["train"][0]
    assert np.isfinite(X).all()
    assert abs(X[:, 0].mean()) < 1e-5 and X[:, 0].std() == pytest.approx(1, rel=1e-4)  # standardised (no missing)


def test_validation_and_test_rows_never_reach_a_statistic(imputed, tmp_path):
    """Change every validation and test row wildly (and give them a new category): the fitted
    record is the same, and the new category lands in the unknown bucket."""
    frame, cfg, prefix, manifest = imputed
    held_out = np.concatenate([ids for split, (_, ids) in split_rows(manifest, prefix, tmp_path).items()
                               if split != "train"])
    changed = frame.copy()
    changed.loc[held_out, ["small", "big"]] = 1e6
    changed.loc[held_out, "colour"] = "purple"
    changed.to_csv(tmp_path / "changed.csv", index=False)
    other = shard_dataset(cfg.replace(data={"source_uri": str(tmp_path / "changed.csv")}), str(tmp_path / "s2"))
    before, after = dict(manifest["preprocessing"]), dict(other["preprocessing"])
    before.pop("imputed"), after.pop("imputed")
    assert after == before
    (tmp_path / "dl").mkdir()
    X, ids = split_rows(other, str(tmp_path / "s2"), tmp_path / "dl")["test"]
    purple = changed.loc[ids, "colour"].eq("purple").to_numpy()
    assert purple.all() and (X[:, -1] == 1).all() and (X[:, 2:5] == 0).all()


def test_the_served_transform_gives_the_shards_bits(imputed, tmp_path):
    """The model's copy of the transform (raw DataFrame → features) equals the sharder's, bit for
    bit, on every split; and the test split's raw-equivalent rows map back to the same features."""
    frame, _, prefix, manifest = imputed
    prep = manifest["preprocessing"]
    for split, (X, ids) in split_rows(manifest, prefix, tmp_path).items():
        raw = frame.iloc[ids].drop(columns="label").reset_index(drop=True)
        np.testing.assert_array_equal(raw_features(prep, raw), X, err_msg=split)
        np.testing.assert_allclose(raw_features(prep, raw_frame(prep, X)), X, atol=1e-5, err_msg=split)
    unseen = pd.DataFrame({"small": [None], "big": [np.nan], "colour": ["ultraviolet"]})
    out = raw_features(prep, unseen)
    assert out[0, -1] == 1 and np.isfinite(out).all()


def test_preprocessing_settings_are_part_of_the_cache_key(tmp_path):
    table().to_csv(tmp_path / "t.csv", index=False)
    cfg = config(str(tmp_path / "t.csv"), missing_values="impute")
    first, _, _ = shard_content_addressed(cfg, str(tmp_path / "root"))
    again, _, reused = shard_content_addressed(cfg, str(tmp_path / "root"))
    raw, manifest, _ = shard_content_addressed(cfg.replace(data={"standardize": False}), str(tmp_path / "root"))
    assert again == first and reused and raw != first
    assert manifest["preprocessing"]["standardize"] is False
    assert manifest["sharding"]["preprocessing"] == {"version": 2, "standardize": False, "missing_values": "impute"}


def test_nothing_to_do_keeps_the_values_as_read(tmp_path):
    frame = table().drop(columns="colour").fillna(1.0)
    frame.to_csv(tmp_path / "t.csv", index=False)
    manifest = shard_dataset(config(str(tmp_path / "t.csv"), standardize=False), str(tmp_path / "s"))
    assert manifest["preprocessing"] is None and manifest["feature_columns"] == ["small", "big"]
    X, ids = split_rows(manifest, str(tmp_path / "s"), tmp_path)["val"]
    np.testing.assert_array_equal(X, frame.loc[ids, ["small", "big"]].to_numpy(np.float32))


def test_missing_values_fail_validation_by_default_naming_the_columns(tmp_path):
    table().to_csv(tmp_path / "t.csv", index=False)
    cfg = config(str(tmp_path / "t.csv"))
    shard_dataset(cfg, str(tmp_path / "s"))
    with pytest.raises(DataValidationError) as err:
        validate_shards(str(tmp_path / "s"), cfg)
    assert "big" in str(err.value) and "colour=blue" in str(err.value)


def test_imputed_counts_are_in_the_validation_report(imputed, tmp_path):
    _, cfg, prefix, manifest = imputed
    summary = validate_shards(prefix, cfg, report_prefix=str(tmp_path / "report"))
    report = json.loads((tmp_path / "report" / "validation.json").read_text())
    assert summary["imputed"] == report["imputed"] == manifest["preprocessing"]["imputed"]
    assert "Imputed values (" in (tmp_path / "report" / "validation.html").read_text()


def test_a_declared_feature_range_is_of_raw_values(tmp_path):
    frame = table().drop(columns="colour").fillna(0.01)
    frame.loc[7, "small"] = 2.0
    frame.to_csv(tmp_path / "t.csv", index=False)
    cfg = config(str(tmp_path / "t.csv"), feature_range=(-1.0, 1e5))
    shard_dataset(cfg, str(tmp_path / "s"))
    validate_shards(str(tmp_path / "s"), cfg)  # standardised values are far outside, raw ones are not
    tight = cfg.replace(data={"feature_range": (-1.0, 1.0)})
    with pytest.raises(DataValidationError, match="small"):
        validate_shards(str(tmp_path / "s"), tight)


@pytest.mark.parametrize("action", ["warn", "fail", "off"])
def test_labels_that_look_accidental(action, tmp_path):
    frame = table().fillna({"big": 1.0, "colour": "red"})
    frame["label"] = frame["label"].map({0: "cat", 1: "dog", 2: "bird"})
    frame.loc[[5, 300, 450], "label"] = "Cat "  # a typo, three rows
    frame.to_csv(tmp_path / "t.csv", index=False)
    cfg = config(str(tmp_path / "t.csv"), rare_label_action=action)
    shard_dataset(cfg, str(tmp_path / "s"))
    if action == "fail":
        with pytest.raises(DataValidationError, match=r"'Cat ': 3 rows .*e\.g\. source row (5|300|450)"):
            validate_shards(str(tmp_path / "s"), cfg)
        return
    summary = validate_shards(str(tmp_path / "s"), cfg)
    warned = [w for w in summary["warnings"] if "look accidental" in w]
    assert len(warned) == (1 if action == "warn" else 0)
    # declared classes are intended, however rare
    declared = cfg.replace(data={"classes": ["bird", "cat", "dog", "Cat "], "rare_label_action": "fail"})
    shard_dataset(declared, str(tmp_path / "s2"))
    validate_shards(str(tmp_path / "s2"), declared)
