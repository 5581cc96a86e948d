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

Regression (a manifest with float targets): the frame holds each target as ``true_<target>``;
``evaluate_regressor`` scores the model with the default *regressor* evaluator on the first target
(MLflow's evaluator takes one target column: ``root_mean_squared_error``, ``mean_absolute_error``,
``r2_score``, ...) and computes ``test_rmse``, ``test_mae`` and ``test_r2`` over every target
(``common.task_metrics``); it also returns the predictions, for the predicted-vs-true plot.

Importing this module is cheap (stdlib only); mlflow, pandas, numpy and the model's own imports
(mxnet) load inside the functions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from common.errors import DeterministicError

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

# The label column of the evaluation data (the model's own output column is ``label``).
TARGET_COLUMN = "true_label"
DATASET_NAME = "test split"


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


def load_test_split(shards_prefix: str, work_dir: str) -> EvaluationData:
    """The test split of a sharded dataset (its source: the manifest), downloaded into ``work_dir``.

    With table preprocessing the rows are raw-equivalent (``raw_frame``):
    the input a model that preprocesses takes."""
    import numpy as np
    import pandas as pd

    from common.manifest import is_regression, load_manifest, manifest_uri
    from common.preprocessing import input_columns
    from training.feed import data

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
    X, y = data.fetch_split(manifest, shards_prefix, test, work_dir)
    if len(y) == 0:
        raise EvaluationError(f"{shards_prefix} has no test rows to evaluate on")
    frame = raw_frame(prep, X) if prep else pd.DataFrame(X.astype("float64"), columns=columns)
    if regression:
        for j, name in enumerate(shell.truth_columns):
            frame[name] = y[:, j].astype("float64")
    else:
        frame[TARGET_COLUMN] = np.asarray(shell.classes, dtype=object)[np.asarray(y, dtype=np.int64)]
    return EvaluationData(frame=frame, classes=shell.classes, source_uri=shell.source_uri, task=shell.task,
                          target_columns=shell.target_columns)


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
    metrics: dict[str, float]  # test_rmse, test_mae, test_r2 over every target
    predictions: Any  # numpy [n, num_targets], in the order of the test rows


def evaluate_regressor(model_uri: str, data: EvaluationData, dataset: Any, *, model_id: str | None,
                       what: str) -> RegressionScores:
    """Score a regression model on ``data`` (its ``dataset()`` as ``dataset``): MLflow's default
    regressor evaluator on the first target, linked to the LoggedModel ``model_id`` like
    ``evaluate_model``, and RMSE, MAE and R² over every target."""
    import mlflow
    import numpy as np

    from common.task_metrics import regression_metrics

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
    true = data.frame[data.truth_columns].to_numpy(np.float64)
    metrics = {f"test_{k}": v for k, v in regression_metrics(predicted, true).items()}
    return RegressionScores(result=result, metrics=metrics, predictions=predicted)


@dataclass(frozen=True)
class Scores:
    """One model's scores on a test split (``score_model``)."""

    result: Any  # MLflow's EvaluationResult; a regressor's metrics include test_rmse, test_mae, test_r2
    predictions: Any = None  # a regressor's: numpy [n, num_targets], in the order of the test rows


def score_model(model_uri: str, test: EvaluationData, dataset: Any, *, model_id: str | None, what: str,
                step: int = 0) -> Scores:
    """Score the model at ``model_uri`` on ``test`` (its ``dataset()`` as ``dataset``) in the active
    run, linked to the LoggedModel ``model_id``, by the test split's task: a classifier with
    ``evaluate_model``; a regressor with ``evaluate_regressor``, whose ``test_rmse``/``test_mae``/
    ``test_r2`` are logged at ``step`` (linked like the evaluator's) and added to the result's
    metrics. The one scoring of the project: registration and review both call it, so a model
    gets the same metrics wherever it is scored."""
    if test.task != "regression":
        return Scores(evaluate_model(model_uri, dataset, test.classes, model_id=model_id, what=what))
    import mlflow

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
