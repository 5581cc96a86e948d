"""Score a logged model on a held-out test split with MLflow's evaluation API.

``evaluate_model`` loads a model through ``mlflow.pyfunc`` exactly as a serving job would and
scores it with ``mlflow.models.evaluate`` (the default classifier evaluator: accuracy, precision,
recall, F1, a per-class table and a confusion matrix; SHAP explanations off), linked to its
LoggedModel (``model_id``): the metrics land on the active run and on the model's page alike,
with the test split as their dataset. The training DAG's register step scores the model it just
logged; a review scores challenger and champion the same way. ``load_test_split`` reads a sharded
dataset's test split as the data to score on.

Importing this module is cheap (stdlib only); mlflow, pandas, numpy and the model's own imports
(mxnet) load inside the functions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# The label column of the evaluation data (the model's own output column is ``label``).
TARGET_COLUMN = "true_label"
DATASET_NAME = "test split"


class EvaluationError(ValueError):
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

    def dataset(self) -> Any:
        """The rows as an ``mlflow.data`` dataset named ``DATASET_NAME``: scoring two models on it
        names the same dataset (same digest) on each one's metrics."""
        import mlflow.data

        from training.tracking.run_extras import dataset_source

        return mlflow.data.from_pandas(self.frame, source=dataset_source(self.source_uri), targets=TARGET_COLUMN,
                                       name=DATASET_NAME)


def load_test_split(shards_prefix: str, work_dir: str) -> EvaluationData:
    """The test split of a sharded dataset (its source: the manifest), downloaded into ``work_dir``.

    With table preprocessing the rows are raw-equivalent (``common.preprocessing.raw_frame``):
    the input a model that preprocesses takes."""
    import numpy as np
    import pandas as pd

    from common.manifest import manifest_uri
    from common.preprocessing import input_columns, raw_frame
    from training.feed import data

    manifest = data.load_manifest(shards_prefix)
    prep = manifest.get("preprocessing")
    columns = [str(c) for c in (input_columns(prep) if prep else manifest["feature_columns"])]
    if TARGET_COLUMN in columns:
        raise EvaluationError(f"{shards_prefix}: a feature column is named {TARGET_COLUMN!r}, the evaluation's "
                              "label column")
    test = [s for s in manifest["shards"] if s["split"] == "test"]
    X, y = data.fetch_split(manifest, shards_prefix, test, work_dir)
    if len(y) == 0:
        raise EvaluationError(f"{shards_prefix} has no test rows to evaluate on")
    classes = [class_key(c) for c in manifest["classes"]]
    frame = raw_frame(prep, X) if prep else pd.DataFrame(X.astype("float64"), columns=columns)
    frame[TARGET_COLUMN] = np.asarray(classes, dtype=object)[np.asarray(y, dtype=np.int64)]
    return EvaluationData(frame=frame, classes=classes, source_uri=manifest_uri(shards_prefix))


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
