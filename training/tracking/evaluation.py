"""Score a logged model on a held-out test split with MLflow's evaluation API.

``score_model`` is the one entry point (registration and review call it): it picks the
evaluation by the test split's task. ``evaluate_model`` loads a model through ``mlflow.pyfunc``
exactly as a serving job would and scores it with ``mlflow.models.evaluate`` (the default
classifier evaluator: accuracy, precision, recall, F1, a per-class table and a confusion
matrix; SHAP explanations off), linked to its LoggedModel (``model_id``): the metrics land on
the active run and on the model's page alike, with the test split as their dataset. The
training DAG's register step scores the model it just logged; a review scores challenger and
champion the same way. ``load_test_split`` reads a sharded dataset's test split as the data to
score on.

Memory stays bounded whatever the split's size. ``mlflow.models.evaluate`` takes one pandas frame
(and copies it more than once), so it scores at most ``max_rows`` rows of the split
(``data.evaluation_rows``; ``DEFAULT_EVALUATION_ROWS`` for a review): a sample drawn with the
manifest's seed, the same rows for the same shards, in split order. The metrics the project
computes itself (a classifier's ``test_accuracy``; a regressor's ``test_rmse``, ``test_mae``,
``test_r2``) are computed over the whole split in chunks of ``CHUNK_ROWS``
(``whole_split_metrics``), reading the test shards block by block (``common.record_codec.iter_blocks``):
not memory-mapped, so no page of the split stays counted in the process's resident memory.

Regression (a manifest with float targets): the frame holds each target as ``true_<target>``;
``evaluate_regressor`` scores the model with the default *regressor* evaluator on the first target
(MLflow's evaluator takes one target column: ``root_mean_squared_error``, ``mean_absolute_error``,
``r2_score``, ...) and computes ``test_rmse``, ``test_mae`` and ``test_r2`` over every target
(``common.task_metrics``); it also returns the predictions, for the predicted-vs-true plot.

Importing this module is cheap (stdlib only); mlflow, pandas, numpy and the model's own imports
(mxnet) load inside the functions.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.errors import DeterministicError

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

# The label column of the evaluation data (the model's own output column is ``label``).
TARGET_COLUMN = "true_label"
DATASET_NAME = "test split"
# Rows of a test split mlflow.models.evaluate scores when the caller sets no cap (a review): at
# 128 float features about 100 MB as the evaluator's float64 frame, and a sampling error of
# accuracy within ±0.3 % (two standard errors). The data.evaluation_rows field's default too.
DEFAULT_EVALUATION_ROWS = 100_000
# Rows per chunk of the whole-split metrics: a frame of this many rows at a time.
CHUNK_ROWS = 50_000


class EvaluationError(DeterministicError, ValueError):
    """A model cannot be scored as asked: no test rows, or the model cannot score them."""


def class_key(value: Any) -> str:
    """A class value as a string: class values come back from JSON, CSV and pandas with different
    types (``3``, ``3.0``, ``"3"``), and the evaluator must see one type on both sides."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


@dataclass(frozen=True)
class EvaluationData:
    """Held-out rows to score a model on."""

    frame: Any  # pandas: the model's input columns (float64, or text categories), the class values in TARGET_COLUMN
    classes: list[str]  # every class the model may predict, as ``class_key`` strings
    source_uri: str  # where the rows come from (a shard manifest's URI, or a local file)
    task: str = "classification"
    target_columns: list[str] = field(default_factory=list)  # regression: the model's output columns
    # The whole split, when ``frame`` holds a sample of it: its shard files, read block by
    # block, and how a block becomes a frame like ``frame``. None: ``frame`` is the whole split.
    whole: Any = field(default=None, compare=False, repr=False)

    @property
    def split_rows(self) -> int:
        """Rows of the whole split (``frame`` may hold fewer: a sample)."""
        return len(self.frame) if self.whole is None else self.whole.num_rows

    def chunks(self, chunk_rows: int = CHUNK_ROWS) -> Iterator[Any]:
        """The whole split in order, as frames of at most ``chunk_rows`` rows with ``frame``'s columns."""
        if self.whole is None:
            for start in range(0, len(self.frame), chunk_rows):
                yield self.frame.iloc[start:start + chunk_rows]
            return
        for X, y in self.whole.blocks(chunk_rows):
            yield self.whole.frame(X, y)

    @property
    def truth_columns(self) -> list[str]:
        """The frame's columns of true values: ``TARGET_COLUMN``, or ``true_<target>`` per target."""
        if self.task == "regression":
            return [f"true_{t}" for t in self.target_columns]
        return [TARGET_COLUMN]

    def dataset(self) -> Any:
        """The rows as an ``mlflow.data`` dataset named ``DATASET_NAME``: scoring two models on it
        names the same dataset (same digest) on each one's metrics."""
        import mlflow.data

        from training.tracking.run_extras import dataset_source

        return mlflow.data.from_pandas(self.frame, source=dataset_source(self.source_uri),
                                       targets=self.truth_columns[0], name=DATASET_NAME)


@dataclass(frozen=True)
class WholeSplit:
    """A test split on local disk, read block by block (``EvaluationData.whole``)."""

    pairs: list[tuple[str, str]]  # (idx, rec) of each shard, verified (common.manifest.download_shard)
    num_features: int
    num_targets: int  # regression: the raw targets follow the features in each record
    num_rows: int
    frame: Callable[[Any, Any], Any]  # (features, labels or targets) → a frame like EvaluationData.frame

    def blocks(self, rows: int) -> Iterator[tuple[Any, Any]]:
        """The split's ``(features, labels or targets)`` in order, at most ``rows`` rows at a time."""
        from common import record_codec

        f = self.num_features
        for idx, rec in self.pairs:
            for block in record_codec.iter_blocks(idx, rec, f + self.num_targets, rows):
                yield block.features[:, :f], (block.features[:, f:] if self.num_targets else block.labels)

    def gather(self, picked: Any, rows: int = CHUNK_ROWS) -> tuple[Any, Any]:
        """Rows ``picked`` (sorted) of the split, in one pass over its blocks."""
        import numpy as np

        xs, ys, start = [], [], 0
        for X, y in self.blocks(rows):
            a, b = np.searchsorted(picked, [start, start + len(X)])
            xs.append(X[picked[a:b] - start])
            ys.append(y[picked[a:b] - start])
            start += len(X)
        return np.concatenate(xs), np.concatenate(ys)


def sample_rows(num_rows: int, max_rows: int, seed: int) -> np.ndarray:
    """The rows (sorted) of a split of ``num_rows`` that evaluation scores: all of them when
    ``max_rows`` is 0 or not smaller, else ``max_rows`` drawn without replacement, seeded by
    ``seed`` and the split's size (the same shards give the same rows)."""
    import numpy as np

    if not max_rows or num_rows <= max_rows:
        return np.arange(num_rows, dtype=np.int64)
    return np.sort(np.random.default_rng([seed, num_rows]).choice(num_rows, max_rows, replace=False))


def load_test_split(shards_prefix: str, work_dir: str, *, max_rows: int = DEFAULT_EVALUATION_ROWS) -> EvaluationData:
    """The test split of a sharded dataset (its source: the manifest), downloaded into ``work_dir``;
    ``frame`` holds at most ``max_rows`` of its rows (``sample_rows``; 0: all),
    ``whole`` the split for ``whole_split_metrics``. Use it while ``work_dir`` exists.

    With table preprocessing the rows are raw-equivalent (``raw_frame``):
    the input a model that preprocesses takes."""
    import numpy as np
    import pandas as pd

    from common.manifest import download_shard, is_regression, load_manifest, manifest_uri
    from common.preprocessing import input_columns

    manifest = load_manifest(shards_prefix)
    prep = manifest.get("preprocessing")
    columns = [str(c) for c in (input_columns(prep) if prep else manifest["feature_columns"])]
    regression = is_regression(manifest)
    shell = EvaluationData(frame=None, classes=[class_key(c) for c in manifest["classes"]],
                           source_uri=manifest_uri(shards_prefix), task=manifest.get("task", "classification"),
                           target_columns=[str(c) for c in manifest.get("target_columns", [])])
    clash = sorted(set(columns) & set(shell.truth_columns))
    if clash:
        raise EvaluationError(f"{shards_prefix}: feature columns {clash} have the names of the evaluation's "
                              "true values")
    test = [s for s in manifest["shards"] if s["split"] == "test"]
    num_rows = sum(int(s["count"]) for s in test)
    if num_rows == 0:
        raise EvaluationError(f"{shards_prefix} has no test rows to evaluate on")

    def to_frame(X: np.ndarray, y: np.ndarray) -> pd.DataFrame:
        frame = raw_frame(prep, X) if prep else pd.DataFrame(X.astype("float64"), columns=columns)
        if regression:
            for j, name in enumerate(shell.truth_columns):
                frame[name] = y[:, j].astype("float64")
        else:
            frame[TARGET_COLUMN] = np.asarray(shell.classes, dtype=object)[np.asarray(y, dtype=np.int64)]
        return frame

    # The targets (regression) as recorded, unscaled: the model is scored in their units.
    whole = WholeSplit([download_shard(manifest, shards_prefix, s["name"], work_dir) for s in test],
                       manifest["num_features"], int(manifest.get("num_targets", 0)) if regression else 0,
                       num_rows, to_frame)
    picked = sample_rows(num_rows, max_rows, int(manifest.get("seed", 0)))
    return EvaluationData(frame=to_frame(*whole.gather(picked)).reset_index(drop=True), classes=shell.classes,
                          source_uri=shell.source_uri, task=shell.task, target_columns=shell.target_columns,
                          whole=whole)


def whole_split_metrics(model: Any, data: EvaluationData, *, what: str,
                        chunk_rows: int = CHUNK_ROWS) -> dict[str, float]:
    """The project's own test metrics of the pyfunc ``model`` over the whole split, a chunk of
    ``chunk_rows`` rows at a time (``EvaluationData.chunks``): a classifier's ``test_accuracy``;
    a regressor's ``test_rmse``, ``test_mae``, ``test_r2`` over every target
    (``common.task_metrics.RegressionSums``, what ``regression_metrics`` gives on one array)."""
    import numpy as np

    from common.task_metrics import RegressionSums

    sums = RegressionSums() if data.task == "regression" else None
    correct = total = 0
    for chunk in data.chunks(chunk_rows):
        features = chunk.drop(columns=data.truth_columns)
        try:
            out = model.predict(features)
        except Exception as exc:  # e.g. a model trained on other features
            raise EvaluationError(f"{what} cannot score the test data: {exc}") from exc
        if sums is not None:
            sums.add(out[data.target_columns].to_numpy(np.float64), chunk[data.truth_columns].to_numpy(np.float64))
        else:
            correct += int((out["label"].map(class_key).to_numpy() == chunk[TARGET_COLUMN].to_numpy()).sum())
            total += len(chunk)
    if sums is not None:
        return {f"test_{k}": v for k, v in sums.metrics().items()}
    return {"test_accuracy": correct / max(total, 1)}


def evaluate_model(model_uri: str, dataset: Any, classes: Sequence[str], *, model_id: str | None,
                   what: str) -> Any:
    """Score the model at ``model_uri`` on ``dataset`` (``EvaluationData.dataset()``) with the default
    classifier evaluator, in the active run (one is started if none is) and linked to the
    LoggedModel ``model_id`` (None: to no model). Returns the ``EvaluationResult``; ``what`` names
    the model in errors. Runs under the caller's tracking URI (evaluate logs through the fluent API).
    """
    import mlflow

    model = mlflow.pyfunc.load_model(model_uri)
    known = set(classes)

    def predict(features: Any) -> Any:
        # The classifier evaluator wants one column of predictions; the model also returns
        # the probability of each.
        try:
            labels = model.predict(features)["label"].map(class_key)
        except Exception as exc:  # e.g. a model trained on other features
            raise EvaluationError(f"{what} cannot score the test data: {exc}") from exc
        unknown = sorted(set(labels) - known)
        if unknown:
            raise EvaluationError(f"{what} predicts classes {unknown[:10]} that the test data does not have "
                                  f"({list(classes)[:20]})")
        return labels

    return mlflow.models.evaluate(
        model=predict, data=dataset, model_type="classifier", evaluators="default", model_id=model_id,
        # SHAP is not installed, and would cost minutes on wide inputs.
        evaluator_config={"label_list": list(classes), "log_model_explainability": False})


@dataclass(frozen=True)
class RegressionScores:
    result: Any  # MLflow's EvaluationResult (the first target)
    metrics: dict[str, float]  # test_rmse, test_mae, test_r2 over every target and the whole split
    predictions: Any  # numpy [n, num_targets], of the frame's rows (the sample), in their order


def evaluate_regressor(model_uri: str, data: EvaluationData, dataset: Any, *, model_id: str | None,
                       what: str) -> RegressionScores:
    """Score a regression model on ``data`` (its ``dataset()`` as ``dataset``): MLflow's default
    regressor evaluator on the first target and the frame's rows, linked to the LoggedModel
    ``model_id`` like ``evaluate_model``, and RMSE, MAE and R² over every target and the whole
    split (``whole_split_metrics``)."""
    import mlflow
    import numpy as np

    model = mlflow.pyfunc.load_model(model_uri)
    features = data.frame.drop(columns=data.truth_columns)
    try:
        predicted = model.predict(features)[data.target_columns].to_numpy(np.float64)
    except Exception as exc:  # e.g. a model trained on other features or targets
        raise EvaluationError(f"{what} cannot score the test data: {exc}") from exc
    first = data.target_columns[0]

    def predict(rows: Any) -> Any:  # the evaluator's frame: features (and any further true_* columns)
        return model.predict(rows)[first].to_numpy(np.float64)

    result = mlflow.models.evaluate(model=predict, data=dataset, model_type="regressor", evaluators="default",
                                    model_id=model_id, evaluator_config={"log_model_explainability": False})
    metrics = whole_split_metrics(model, data, what=what)
    return RegressionScores(result=result, metrics=metrics, predictions=predicted)


@dataclass(frozen=True)
class Scores:
    """One model's scores on a test split (``score_model``)."""

    result: Any  # MLflow's EvaluationResult; a regressor's metrics include test_rmse, test_mae, test_r2
    predictions: Any = None  # a regressor's: numpy [n, num_targets], of the frame's rows


def score_model(model_uri: str, test: EvaluationData, dataset: Any, *, model_id: str | None, what: str,
                step: int = 0) -> Scores:
    """Score the model at ``model_uri`` on ``test`` (its ``dataset()`` as ``dataset``) in the active
    run, linked to the LoggedModel ``model_id``, by the test split's task: a classifier with
    ``evaluate_model``, and its ``test_accuracy`` over the whole split added to the result's
    metrics (the caller logs it); a regressor with ``evaluate_regressor``, whose
    ``test_rmse``/``test_mae``/``test_r2`` (the whole split) are logged at ``step`` (linked like
    the evaluator's) and added to the result's metrics. The one scoring of the project:
    registration and review both call it, so a model gets the same metrics wherever it is scored."""
    import mlflow

    if test.task != "regression":
        result = evaluate_model(model_uri, dataset, test.classes, model_id=model_id, what=what)
        result.metrics.update(whole_split_metrics(mlflow.pyfunc.load_model(model_uri), test, what=what))
        return Scores(result)
    scores = evaluate_regressor(model_uri, test, dataset, model_id=model_id, what=what)
    for key, value in scores.metrics.items():
        mlflow.log_metric(key, value, step=step, model_id=model_id, dataset=dataset)
    scores.result.metrics.update(scores.metrics)
    return Scores(scores.result, scores.predictions)


def raw_frame(record: dict[str, Any], X: np.ndarray) -> pd.DataFrame:
    """Shard features ``[n, len(output_columns)]`` → raw-equivalent input columns (what the
    registered model takes: it is scored through its raw-table path)."""
    import numpy as np
    import pandas as pd

    from common import preprocessing

    numbers = preprocessing.raw_numbers(record, X)
    columns: dict[str, Any] = {}
    j = 0
    for col in record["inputs"]:
        if col["kind"] == "numeric":
            columns[col["name"]] = numbers[:, j]
            j += 1
            continue
        width = len(col["categories"]) + 1
        names = np.array([*col["categories"], preprocessing.unknown_value(col["categories"])], dtype=object)
        columns[col["name"]] = names[X[:, j:j + width].argmax(axis=1)] if len(X) else names[:0]
        j += width
    return pd.DataFrame(columns)
