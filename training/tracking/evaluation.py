"""Evaluate an exported classifier on held-out data: accuracy, per-class counts, confusion matrix.

numpy and the export loader (mxnet) are imported inside ``evaluate_classifier``: importing this
module is cheap, so Airflow plugins may import it at module level.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def label_indices(y: Sequence[Any], classes: Sequence[Any], labels: str = "auto") -> list[int]:
    """Class indices of ``y``, given as original class values or as indices into ``classes``.

    ``labels="auto"`` accepts either when only one reading fits, or when both agree
    (``classes == [0, 1, …]``); otherwise it refuses to guess.
    """
    if labels not in ("auto", "value", "index"):
        raise ValueError(f"labels must be 'auto', 'value' or 'index', got {labels!r}")
    k = len(classes)
    by_value = {c: i for i, c in enumerate(classes)}
    values = list(y)
    as_value = [by_value.get(v) for v in values] if labels != "index" else None
    value_ok = as_value is not None and None not in as_value
    as_index = None
    if labels != "value":
        ints = [int(v) if isinstance(v, (int, float)) and float(v).is_integer() else -1 for v in values]
        as_index = ints if all(0 <= i < k for i in ints) else None
    if labels == "value" or (labels == "auto" and value_ok and (as_index is None or as_index == as_value)):
        if not value_ok:
            unknown = sorted({v for v, i in zip(values, as_value or []) if i is None}, key=str)
            raise ValueError(f"labels {unknown[:10]} are not among the model's classes {list(classes)[:20]}")
        return as_value  # type: ignore[return-value]
    if as_index is not None and (labels == "index" or not value_ok):
        return as_index
    if labels == "index":
        raise ValueError(f"labels must be class indices in [0, {k}), got values outside that range")
    if value_ok:
        raise ValueError(
            "labels fit both as class values and as class indices and the two readings differ; "
            "pass labels='value' or labels='index'"
        )
    raise ValueError(f"labels are neither values of the model's classes {list(classes)[:20]} nor indices in [0, {k})")


def evaluate_classifier(model_dir: str, X: Any, y: Any, *, labels: str = "auto") -> dict[str, Any]:
    """Accuracy, per-class counts and confusion matrix of an export on ``X``.

    Uses the exported symbol directly (no MLflow round trip). ``y`` holds original class values
    or class indices (the record labels); see ``label_indices``. ``confusion_matrix[i][j]``
    counts examples of ``classes[i]`` predicted as ``classes[j]``.
    """
    import numpy as np

    from training.tracking.pyfunc_model import find_export_files, load_exported

    files = find_export_files(model_dir)
    loaded = load_exported(files["symbol"], files["params"], files["meta"])
    classes = loaded.classes
    truth = np.asarray(label_indices(np.asarray(y).tolist(), classes, labels), dtype=np.int64)
    n = int(len(truth))
    X_arr = np.asarray(X, dtype=np.float32).reshape(n, -1)
    predicted = loaded.predict_proba(X_arr).argmax(axis=1) if n else np.zeros(0, dtype=np.int64)
    k = len(classes)
    confusion = np.zeros((k, k), dtype=np.int64)
    np.add.at(confusion, (truth, predicted), 1)
    return {
        "accuracy": float(np.trace(confusion) / n) if n else math.nan,
        "num_examples": n,
        "classes": classes,
        "class_counts": {str(c): int(confusion[i].sum()) for i, c in enumerate(classes)},
        "predicted_counts": {str(c): int(confusion[:, i].sum()) for i, c in enumerate(classes)},
        "confusion_matrix": confusion.tolist(),
    }
