"""The register step's evaluation in bounded memory (``training.tracking.evaluation``): the
evaluator scores a seeded sample of the test split, the project's own test metrics cover the
whole split in chunks, and chunked regression metrics equal the one-array ones."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from common.config import DataConfig, TrainConfig
from common.task_metrics import RegressionSums, regression_metrics
from data_checks.shard import shard_dataset
from training.tracking import evaluation as ev

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def digits_shards(digits_csv: bytes, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("digits")
    source = folder / "digits.csv"
    source.write_bytes(digits_csv)
    prefix = str(folder / "shards")
    shard_dataset(TrainConfig.from_dict({"data": {"source_uri": str(source), "label_column": "label"}}), prefix)
    return prefix


class Guess:
    """A pyfunc stand-in: the true class of a row whose first pixel column is above ``cut``, else "0"
    (so its accuracy differs from one subset of rows to another)."""

    def __init__(self, truth: dict[tuple, str], cut: float) -> None:
        self.truth, self.cut = truth, cut

    def predict(self, features: pd.DataFrame) -> pd.DataFrame:
        first = features.iloc[:, 0].to_numpy()
        labels = [self.truth[tuple(row)] if x > self.cut else "0"
                  for row, x in zip(features.to_numpy().round(6).tolist(), first)]
        return pd.DataFrame({"label": labels})


def test_the_sample_is_seeded_sorted_and_bounded():
    picked = ev.sample_rows(10_000, 300, seed=7)
    assert len(picked) == 300 and len(np.unique(picked)) == 300 and (np.diff(picked) > 0).all()
    assert picked.max() < 10_000
    np.testing.assert_array_equal(picked, ev.sample_rows(10_000, 300, seed=7))
    assert not np.array_equal(picked, ev.sample_rows(10_000, 300, seed=8))
    np.testing.assert_array_equal(ev.sample_rows(200, 300, seed=7), np.arange(200))
    np.testing.assert_array_equal(ev.sample_rows(200, 0, seed=7), np.arange(200))


def test_the_default_cap_is_the_config_default():
    assert DataConfig().evaluation_rows == ev.DEFAULT_EVALUATION_ROWS


def test_the_frame_is_a_sample_of_the_whole_split_and_the_chunks_are_all_of_it(digits_shards, tmp_path):
    whole = ev.load_test_split(digits_shards, str(tmp_path / "a"), max_rows=0)
    n = len(whole.frame)
    assert n > 300 and whole.split_rows == n
    sample = ev.load_test_split(digits_shards, str(tmp_path / "b"), max_rows=100)
    assert len(sample.frame) == 100 and sample.split_rows == n
    picked = ev.sample_rows(n, 100, seed=TrainConfig().seed)
    pd.testing.assert_frame_equal(sample.frame, whole.frame.iloc[picked].reset_index(drop=True))
    chunks = list(sample.chunks(chunk_rows=64))
    assert max(len(c) for c in chunks) == 64
    pd.testing.assert_frame_equal(pd.concat(chunks, ignore_index=True), whole.frame)


def test_accuracy_covers_the_whole_split_not_the_sample(digits_shards, tmp_path):
    whole = ev.load_test_split(digits_shards, str(tmp_path / "a"), max_rows=0)
    sample = ev.load_test_split(digits_shards, str(tmp_path / "b"), max_rows=50)
    features = whole.frame.drop(columns=whole.truth_columns)
    truth = dict(zip(map(tuple, features.to_numpy().round(6).tolist()), whole.frame[ev.TARGET_COLUMN]))
    model = Guess(truth, cut=float(np.median(features.iloc[:, 0])))
    # The expected figure, from the whole frame at once.
    expected = float((model.predict(features)["label"].to_numpy() == whole.frame[ev.TARGET_COLUMN].to_numpy()).mean())
    on_sample = float((model.predict(sample.frame.drop(columns=sample.truth_columns))["label"].to_numpy()
                       == sample.frame[ev.TARGET_COLUMN].to_numpy()).mean())
    assert on_sample != expected  # the sample alone would give another figure
    for data, chunk_rows in ((sample, 37), (sample, 10_000), (whole, 37)):
        got = ev.whole_split_metrics(model, data, what="guess", chunk_rows=chunk_rows)
        assert got == {"test_accuracy": pytest.approx(expected, abs=1e-12)}


@pytest.mark.parametrize("targets", [1, 3])
def test_chunked_regression_metrics_equal_the_one_array_ones(targets):
    rng = np.random.default_rng(0)
    true = rng.normal(50, 20, (1001, targets))
    pred = true + rng.normal(0, 5, true.shape)
    expected = regression_metrics(pred, true)
    for cuts in ([1001], [1, 1000], [10, 400, 591], [333] * 3 + [2]):
        sums, start = RegressionSums(), 0
        for k in cuts:
            sums.add(pred[start:start + k], true[start:start + k])
            start += k
        got = sums.metrics()
        assert got == {k: pytest.approx(v, rel=1e-9) for k, v in expected.items()}


def test_chunked_r2_of_a_constant_target_follows_the_one_array_rule():
    true = np.full((10, 1), 3.0)
    sums = RegressionSums()
    sums.add(true[:4], true[:4])
    sums.add(true[4:], true[4:])
    assert sums.metrics()["r2"] == regression_metrics(true, true)["r2"] == 1.0
    with pytest.raises(ValueError, match="no rows"):
        RegressionSums().metrics()


def test_a_regression_split_reads_its_raw_targets_in_chunks_and_sample(tmp_path):
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    frame = pd.DataFrame(d.data, columns=d.feature_names)
    frame["target"] = d.target
    frame.to_csv(tmp_path / "diabetes.csv", index=False)
    cfg = TrainConfig.from_dict({"data": {"source_uri": str(tmp_path / "diabetes.csv"), "label_column": "target"},
                                 "model": {"task": "regression"}})
    prefix = str(tmp_path / "shards")
    shard_dataset(cfg, prefix)
    whole = ev.load_test_split(prefix, str(tmp_path / "a"), max_rows=0)
    sample = ev.load_test_split(prefix, str(tmp_path / "b"), max_rows=20)
    # The targets as in the source (raw, not standardised), as the model is scored in their units.
    assert set(whole.frame["true_target"]) <= set(d.target.astype(np.float32).astype(np.float64))
    picked = ev.sample_rows(len(whole.frame), 20, seed=cfg.seed)
    pd.testing.assert_frame_equal(sample.frame, whole.frame.iloc[picked].reset_index(drop=True))
    pd.testing.assert_frame_equal(pd.concat(list(sample.chunks(chunk_rows=7)), ignore_index=True), whole.frame)
