"""Regression targets standardised on the train split: fitted at shard time from the train shards
only, recorded in the manifest's preprocessing record, applied to what the network trains on,
and undone wherever predictions are scored (validation metrics) or served (the pyfunc model)."""
from __future__ import annotations

# Before anything imports mxnet (see test_shard.py): scikit-learn must stay importable.
import sklearn.metrics  # noqa: F401

import numpy as np
import pandas as pd
import pytest

from common.config import TrainConfig
from common.preprocessing import TargetScale
from data_checks.shard import shard_dataset, sharding_params
from training.feed import data as feed_data

pytestmark = pytest.mark.unit


def _config(source: str = "", **data: object) -> TrainConfig:
    return TrainConfig.from_dict({"data": {"source_uri": source, "label_column": "y", "target_columns": ["y", "z"],
                                           **data}, "model": {"task": "regression"}})


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Targets far from zero and of very different sizes; the rows' order makes the train split
    differ from the whole table (the split is random, so no split's mean is the table's)."""
    rng = np.random.default_rng(3)
    n = 600
    x = rng.normal(size=(n, 3))
    frame = pd.DataFrame(x, columns=["a", "b", "c"])
    frame["y"] = 5000.0 + 700.0 * np.sin(x[:, 0]) + 50.0 * rng.normal(size=n)
    frame["z"] = 0.002 * x[:, 1] - 3.0
    path = str(tmp_path_factory.mktemp("src") / "t.csv")
    frame.to_csv(path, index=False)
    return path


@pytest.fixture(scope="module")
def sharded(table: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    prefix = str(tmp_path_factory.mktemp("shards") / "run")
    return prefix, shard_dataset(_config(table), prefix)


def _split(manifest: dict, prefix: str, split: str, work: str) -> tuple[np.ndarray, np.ndarray]:
    shards = [s for s in manifest["shards"] if s["split"] == split]
    return feed_data.fetch_split(manifest, prefix, shards, work)


def test_the_scale_is_fitted_on_the_train_split_only(sharded, tmp_path):
    prefix, manifest = sharded
    record = manifest["preprocessing"]["targets"]
    assert [t["name"] for t in record] == ["y", "z"]
    _, train = _split(manifest, prefix, "train", str(tmp_path / "train"))
    _, val = _split(manifest, prefix, "val", str(tmp_path / "val"))
    _, test = _split(manifest, prefix, "test", str(tmp_path / "test"))
    train64 = train.astype(np.float64)
    np.testing.assert_allclose([t["mean"] for t in record], train64.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose([t["std"] for t in record], train64.std(axis=0), rtol=1e-9)
    every = np.concatenate([train, val, test]).astype(np.float64)
    assert abs(record[0]["mean"] - every[:, 0].mean()) > 1e-6  # not the whole table's
    # The shards keep the targets raw (validation checks them in the source's units).
    assert 3000 < train[:, 0].min() and train[:, 0].max() < 7000


def test_the_train_rows_are_fed_standardised_and_the_held_out_splits_raw(sharded, tmp_path):
    prefix, manifest = sharded
    shards = feed_data.shards_for_rank(manifest, 0, 1)
    X_raw, y_raw = feed_data.fetch_split(manifest, prefix, shards, str(tmp_path / "a"))
    rows = feed_data.open_split(manifest, prefix, shards, str(tmp_path / "b"))
    idx = np.arange(rows.num_rows)
    X, y = rows.gather(idx)
    np.testing.assert_array_equal(X, X_raw)
    scale = feed_data.target_scale(manifest)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, scale.standardize(y_raw))
    np.testing.assert_allclose(y.astype(np.float64).mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.astype(np.float64).std(axis=0), 1.0, atol=1e-5)
    # Deterministic: a second open (a resumed job) gathers the same bits.
    again = feed_data.open_split(manifest, prefix, shards, str(tmp_path / "c")).gather(idx[::-1])[1]
    np.testing.assert_array_equal(again, y[::-1])


def test_off_with_data_standardize_false_and_for_shards_written_before(table, tmp_path):
    raw = _config(table, standardize=False)
    manifest = shard_dataset(raw, str(tmp_path / "raw"))
    assert "targets" not in (manifest.get("preprocessing") or {}) and feed_data.target_scale(manifest) is None
    # Shards of before (no target scale in their manifest) get other shards now: the scale is in
    # the sharding settings, only for regression with data.standardize.
    assert sharding_params(_config(table))["target_scaling"] == "standardize"
    assert "target_scaling" not in sharding_params(raw)
    classification = TrainConfig.from_dict({"data": {"source_uri": table, "label_column": "y"}})
    assert "target_scaling" not in sharding_params(classification)


def test_validation_metrics_are_in_the_targets_units(sharded, tmp_path):
    """A net whose output is the standardised target plus 0.5: its validation loss is taken on
    the trained (standardised) scale, its RMSE and MAE are 0.5 std in the targets' units."""
    import mxnet as mx

    from training.loop.validation import evaluate

    prefix, manifest = sharded
    _, y = _split(manifest, prefix, "val", str(tmp_path / "val"))
    scale = feed_data.target_scale(manifest)
    X = scale.standardize(y) + np.float32(0.5)  # the "features" are what the net predicts
    net = mx.gluon.nn.HybridLambda(lambda F, x: F.identity(x))
    cfg = _config()
    got = evaluate(net, X, y, model=cfg.model, targets=scale)
    rmse_each = 0.5 * scale.std
    assert got["rmse"] == pytest.approx(float(np.sqrt((rmse_each ** 2).mean())), rel=1e-5)
    assert got["mae"] == pytest.approx(float(rmse_each.mean()), rel=1e-5)
    assert got["loss"] == pytest.approx(0.5 * 0.25, rel=1e-5)  # gluon L2: 0.5 x squared error, mean over targets
    unscaled = evaluate(net, X, y, model=cfg.model)  # the metrics of the raw outputs, for contrast
    assert unscaled["rmse"] > 10 * got["rmse"]


def test_the_served_model_restores_the_targets_units():
    """The pyfunc model's own copy of the inverse gives TargetScale.restore's values."""
    from training.tracking import pyfunc_model

    record = {"targets": [{"name": "y", "mean": 5000.0, "std": 700.0}, {"name": "z", "mean": -3.0, "std": 0.002}]}
    outputs = np.array([[0.0, 0.0], [1.0, -2.0], [-0.25, 3.5]], np.float32)
    expected = TargetScale.of(record).restore(outputs)
    np.testing.assert_array_equal(pyfunc_model.restore_targets(record, outputs), expected)
    np.testing.assert_allclose(expected[1], [5700.0, -3.004])
    np.testing.assert_array_equal(pyfunc_model.restore_targets({"inputs": []}, outputs), outputs.astype(np.float64))
    np.testing.assert_array_equal(pyfunc_model.restore_targets(None, outputs), outputs.astype(np.float64))


def test_the_loaded_model_predicts_in_the_targets_units(tmp_path):
    """An exported regression net with a preprocessing record that holds the target scale: the
    model's predictions (``predict_frame``) are its outputs x std + mean."""
    import json

    import mxnet as mx

    from training.tracking import pyfunc_model

    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(1, in_units=2))
    net.initialize(mx.init.Constant(0.5))
    net.hybridize()
    x = np.array([[1.0, 2.0], [-1.0, 0.0]], np.float32)
    outputs = net(mx.nd.array(x)).asnumpy()
    net.export(str(tmp_path / "model"), epoch=0)
    (tmp_path / "model_meta.json").write_text(json.dumps({"feature_columns": ["a", "b"], "task": "regression",
                                                          "target_columns": ["y"]}))
    record = {"standardize": True, "inputs": [{"name": "a", "kind": "numeric", "mean": 0.0, "std": 1.0, "fill": None},
                                              {"name": "b", "kind": "numeric", "mean": 0.0, "std": 1.0, "fill": None}],
              "output_columns": ["a", "b"], "targets": [{"name": "y", "mean": 1000.0, "std": 20.0}]}
    (tmp_path / "preprocessing.json").write_text(json.dumps(record))
    files = pyfunc_model.find_export_files(str(tmp_path))
    loaded = pyfunc_model.load_exported(files["symbol"], files["params"], files["meta"], files["preprocessing"])
    frame = pyfunc_model.predict_frame(loaded, loaded.features(pd.DataFrame(x, columns=["a", "b"])))
    np.testing.assert_allclose(frame["y"].to_numpy(), outputs[:, 0].astype(np.float64) * 20.0 + 1000.0, rtol=1e-12)


def test_validation_on_mapped_shards_equals_validation_on_arrays(sharded, tmp_path):
    """Rank 0 validates on its memory-mapped val split a batch at a time (targets unscaled): the
    same metrics as on the loaded arrays, over several batches."""
    import mxnet as mx

    from training.loop.validation import evaluate

    prefix, manifest = sharded
    shards = [s for s in manifest["shards"] if s["split"] == "val"]
    X, y = feed_data.fetch_split(manifest, prefix, shards, str(tmp_path / "a"))
    rows = feed_data.open_split(manifest, prefix, shards, str(tmp_path / "b"), scaled_targets=False)
    assert rows.num_rows == len(y) > 16
    scale = feed_data.target_scale(manifest)
    net = mx.gluon.nn.Dense(2, in_units=X.shape[1])
    net.initialize(mx.init.Xavier())
    model = _config().model
    expected = evaluate(net, X, y, batch=16, model=model, targets=scale)
    got = evaluate(net, rows, batch=16, model=model, targets=scale)
    assert got == {k: pytest.approx(v, rel=1e-6) for k, v in expected.items()}
    assert set(got) == {"loss", "rmse", "mae", "r2"}


def test_classification_validation_on_a_row_source_equals_arrays():
    import mxnet as mx

    from training.feed.shard_reader import LoadedShard, ShardSet
    from training.loop.validation import evaluate

    rng = np.random.default_rng(0)
    X = rng.normal(size=(203, 5)).astype(np.float32)
    y = rng.integers(0, 3, 203).astype(np.int32)
    net = mx.gluon.nn.Dense(3, in_units=5)
    net.initialize(mx.init.Xavier())
    expected = evaluate(net, X, y, batch=50)
    got = evaluate(net, ShardSet([LoadedShard(X[:100]), LoadedShard(X[100:])], [y[:100], y[100:]], 5), batch=50)
    assert got == {k: pytest.approx(v, rel=1e-6) for k, v in expected.items()}
    assert 0 < got["accuracy"] < 1
