"""model.task='regression': config checks, float targets in the shards, the feed, the losses
and metrics, and the names the early stopping and the model review rank by."""
from __future__ import annotations

# Before anything imports mxnet (see test_shard.py): load_diabetes needs scikit-learn importable.
from sklearn.datasets import load_diabetes

import numpy as np
import pandas as pd
import pytest

from common.config import ConfigError, TrainConfig
from data_checks import DataError
from data_checks.shard import shard_dataset
from training.feed import data as feed_data
from training.loop.metrics import higher_is_better, regression_metrics

pytestmark = pytest.mark.unit


def regression_config(source: str = "", **data: object) -> TrainConfig:
    return TrainConfig.from_dict({"data": {"source_uri": source, "label_column": "target", **data},
                                  "model": {"task": "regression"}})


@pytest.fixture(scope="module")
def diabetes_csv(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = load_diabetes()
    frame = pd.DataFrame(d.data, columns=d.feature_names)
    frame["target"] = d.target
    frame["twice"] = 2 * d.target  # a second target for the multi-target cases
    path = str(tmp_path_factory.mktemp("src") / "diabetes.csv")
    frame.to_csv(path, index=False)
    return path


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw,message", [
    ({"model": {"loss": "l2"}},
     "model.loss='l2' does not fit model.task='classification': expected 'auto' or one of ('softmax_cross_entropy',)"),
    ({"model": {"task": "regression", "loss": "softmax_cross_entropy"}},
     "model.loss='softmax_cross_entropy' does not fit model.task='regression'"),
    ({"model": {"loss": "hinge"}}, "model.loss must be one of"),
    ({"model": {"task": "ranking"}}, "model.task must be one of ('classification', 'regression')"),
    ({"data": {"target_columns": ["y"]}}, "data.target_columns is for model.task='regression'"),
    ({"data": {"target_range": [0, 1]}}, "data.target_range is for model.task='regression'"),
    ({"model": {"task": "regression"}, "data": {"classes": [0, 1]}}, "data.classes declares classes"),
    ({"model": {"task": "regression"}, "data": {"target_range": [2, 1]}}, "data.target_range must be empty or"),
    ({"model": {"task": "regression"}, "data": {"target_columns": ["a", "a"]}}, "data.target_columns has duplicates"),
    ({"model": {"task": "regression"}, "data": {"target_columns": ["a"], "feature_columns": ["a", "b"]}},
     "data.target_columns must not include the id or a feature column: ['a']"),
    ({"model": {"task": "regression", "huber_rho": 0}}, "model.huber_rho must be > 0"),
])
def test_wrong_task_settings_are_refused_naming_the_field(raw, message):
    with pytest.raises(ConfigError, match=None) as err:
        TrainConfig.from_dict(raw)
    assert message in str(err.value)


def test_loss_defaults_follow_the_task_and_new_fields_keep_old_digests():
    assert TrainConfig().model.loss_name == "softmax_cross_entropy"
    cfg = regression_config(target_columns=["y1", "y2"])
    assert cfg.model.loss_name == "l2" and cfg.target_columns == ("y1", "y2")
    assert regression_config().target_columns == ("target",)
    # Fields at their default are left out of the digest; set, they change it.
    plain = TrainConfig()
    assert "task" not in plain.digest_dict()["model"] and "task" in plain.to_dict()["model"]
    assert TrainConfig.from_dict({"model": {"task": "classification", "loss": "auto"}}).digest() == plain.digest()
    assert regression_config().digest() != TrainConfig.from_dict({"data": {"label_column": "target"}}).digest()


def test_higher_is_better_names_agree_with_the_metrics():
    assert [higher_is_better(m) for m in ("accuracy", "r2", "val_r2", "test_accuracy")] == [True] * 4
    assert [higher_is_better(m) for m in ("loss", "rmse", "mae", "val_loss", "val_rmse")] == [False] * 5
    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        higher_is_better("f1")


# -- metrics and losses ---------------------------------------------------------------------------


def test_regression_metrics_match_scikit_learn():
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    rng = np.random.default_rng(0)
    true = rng.normal(size=(50, 2))
    pred = true + rng.normal(scale=0.3, size=(50, 2))
    got = regression_metrics(pred, true)
    assert got["rmse"] == pytest.approx(np.sqrt(mean_squared_error(true, pred)))
    assert got["mae"] == pytest.approx(mean_absolute_error(true, pred))
    assert got["r2"] == pytest.approx(r2_score(true, pred))
    one = regression_metrics(pred[:, 0], true[:, 0])  # a single target as a flat vector
    assert one["r2"] == pytest.approx(r2_score(true[:, 0], pred[:, 0]))
    assert regression_metrics(np.ones(3), np.ones(3))["r2"] == 1.0


@pytest.mark.parametrize("loss,expected", [
    ("l2", lambda e: 0.5 * e ** 2), ("l1", np.abs),
    ("huber", lambda e: np.where(np.abs(e) > 1, np.abs(e) - 0.5, 0.5 * e ** 2)),
])
def test_losses_follow_the_config(loss, expected):
    import mxnet as mx

    from training.loop.step import make_loss

    cfg = TrainConfig.from_dict({"model": {"task": "regression", "loss": loss}})
    pred, true = np.array([[0.0], [3.0], [-0.5]], np.float32), np.array([[0.5], [0.0], [0.0]], np.float32)
    got = make_loss(cfg.model)(mx.nd.array(pred), mx.nd.array(true)).asnumpy()
    np.testing.assert_allclose(got, expected(pred - true).ravel(), rtol=1e-6)
    assert type(make_loss(TrainConfig().model)).__name__ == "SoftmaxCrossEntropyLoss"


# -- sharding and the feed ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(diabetes_csv: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, str, dict]:
    # Raw features, so the records can be compared with the source's values.
    cfg = regression_config(diabetes_csv, target_columns=["target", "twice"], standardize=False)
    prefix = str(tmp_path_factory.mktemp("shards") / "run")
    return cfg, prefix, shard_dataset(cfg, prefix)


def test_standardised_regression_shards_keep_the_targets_raw(diabetes_csv, tmp_path):
    """The table transform rewrites the features only: the targets after them stay exact."""
    cfg = regression_config(diabetes_csv, target_columns=["target", "twice"])
    prefix = str(tmp_path / "run")
    manifest = shard_dataset(cfg, prefix)
    assert manifest["preprocessing"]["standardize"]
    train = [s for s in manifest["shards"] if s["split"] == "train"]
    X, y = feed_data.fetch_split(manifest, prefix, train, str(tmp_path / "train"))
    np.testing.assert_allclose(X.mean(axis=0), 0.0, atol=1e-4)  # fitted on this split
    source = pd.read_csv(diabetes_csv)
    assert set(map(tuple, y.tolist())) <= set(map(tuple, source[["target", "twice"]].to_numpy(np.float32).tolist()))


def test_regression_shards_hold_float_targets_after_the_features(sharded, diabetes_csv, tmp_path):
    cfg, prefix, manifest = sharded
    source = pd.read_csv(diabetes_csv)
    assert manifest["task"] == "regression" and manifest["target_columns"] == ["target", "twice"]
    assert manifest["num_targets"] == 2 and manifest["num_features"] == 10 and manifest["classes"] == []
    assert "target" not in manifest["feature_columns"] and "twice" not in manifest["feature_columns"]
    assert sum(manifest["splits"][s]["count"] for s in ("train", "val", "test")) == len(source)
    rows = []
    for split in ("train", "val", "test"):
        shards = [s for s in manifest["shards"] if s["split"] == split]
        X, y = feed_data.fetch_split(manifest, prefix, shards, str(tmp_path / split))
        assert X.shape[1] == 10 and y.shape == (len(X), 2) and y.dtype == np.float32
        rows.append((X, y))
    X, y = map(np.concatenate, zip(*rows))
    # Every source row once, targets exact in float32.
    order = np.lexsort(X.T[::-1])
    src = source[manifest["feature_columns"]].to_numpy(np.float32)
    src_order = np.lexsort(src.T[::-1])
    np.testing.assert_array_equal(X[order], src[src_order])
    np.testing.assert_array_equal(y[order], source[["target", "twice"]].to_numpy(np.float32)[src_order])


def test_mapped_train_rows_gather_features_and_targets(sharded, tmp_path):
    cfg, prefix, manifest = sharded
    shards = feed_data.shards_for_rank(manifest, 0, 2)
    loaded = feed_data.fetch_split(manifest, prefix, shards, str(tmp_path / "a"))
    rows = feed_data.open_split(manifest, prefix, shards, str(tmp_path / "b"))
    idx = np.array([3, 0, 3, rows.num_rows - 1])
    X, y = rows.gather(idx)
    np.testing.assert_array_equal(X, loaded[0][idx])
    np.testing.assert_array_equal(y, loaded[1][idx])


def test_classification_sharding_of_the_same_table_is_unchanged(diabetes_csv, tmp_path):
    cfg = TrainConfig.from_dict({"data": {"source_uri": diabetes_csv, "label_column": "sex"}})
    manifest = shard_dataset(cfg, str(tmp_path / "cls"))
    assert "task" not in manifest and "num_targets" not in manifest and manifest["num_classes"] == 2


def test_a_missing_or_text_target_column_is_named(diabetes_csv, tmp_path):
    with pytest.raises(DataError, match=r"target columns \['nope'\]"):
        shard_dataset(regression_config(diabetes_csv, target_columns=["nope"]), str(tmp_path / "a"))
    text = tmp_path / "text.csv"
    pd.DataFrame({"x": [1.0, 2.0, 3.0], "target": ["a", "b", "c"]}).to_csv(text, index=False)
    with pytest.raises(DataError, match="non-numeric target columns .*'target'"):
        shard_dataset(regression_config(str(text)), str(tmp_path / "b"))


# -- validation -----------------------------------------------------------------------------------


def test_regression_shards_validate_without_label_checks(sharded):
    from data_checks.validate import validate_shards

    cfg, prefix, _ = sharded
    summary = validate_shards(prefix, cfg)
    assert summary["success"]


def test_non_finite_and_out_of_range_targets_fail_naming_the_rows(diabetes_csv, tmp_path):
    from data_checks.errors import DataValidationError
    from data_checks.validate import validate_shards

    frame = pd.read_csv(diabetes_csv)
    frame.loc[7, "target"] = np.nan
    frame.loc[20, "target"] = 1000.0
    path = str(tmp_path / "bad.csv")
    frame.to_csv(path, index=False)
    cfg = regression_config(path, target_range=[0, 400])
    prefix = str(tmp_path / "shards")
    shard_dataset(cfg, prefix)
    with pytest.raises(DataValidationError) as info:
        validate_shards(prefix, cfg)
    message = str(info.value)
    assert "every target is finite" in message and "row 7: target=nan" in message
    assert "every target is within [0, 400]" in message and "row 20: target=1000.0" in message
    assert "label" not in {f["column"] for f in info.value.failures}


def test_the_default_gate_follows_the_task():
    from mlflow.models import EvaluationResult

    from training.tracking.gate import DEFAULT_GATE, DEFAULT_REGRESSION_GATE, evaluate_gate, gate_for_task

    assert gate_for_task(DEFAULT_GATE, "classification") is DEFAULT_GATE
    assert gate_for_task(DEFAULT_GATE, "regression") is DEFAULT_REGRESSION_GATE
    custom = {"r2_score": {"greater_is_better": True, "threshold": 0.3}}
    assert gate_for_task(custom, "regression") is custom

    def scored(rmse: float) -> EvaluationResult:
        return EvaluationResult(metrics={"root_mean_squared_error": rmse}, artifacts={})

    spec = gate_for_task(DEFAULT_GATE, "regression")
    assert evaluate_gate(spec, scored(50.0), scored(52.0))["passed"]  # lower RMSE wins
    assert evaluate_gate(spec, scored(50.4), scored(50.0))["passed"]  # within 1 %
    assert not evaluate_gate(spec, scored(55.0), scored(50.0))["passed"]
