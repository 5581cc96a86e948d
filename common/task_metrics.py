"""The metrics of each ``model.task`` and which way each is better.

Rank 0 reports them on the validation split every epoch (``val_<name>``), the register step on
the test split (``test_<name>``), and the model review and early stopping rank models by them, so
they are defined once, here (numpy only).
"""
from __future__ import annotations

import numpy as np

# What rank 0 reports on the validation split each epoch (as ``val_<name>``), per model.task.
TASK_METRICS = {"classification": ("loss", "accuracy"), "regression": ("loss", "rmse", "mae", "r2")}
# Whether a larger value is better, for every metric of TASK_METRICS: what early stopping and a
# model comparison rank by.
_HIGHER_IS_BETTER = {"accuracy": True, "r2": True, "loss": False, "rmse": False, "mae": False}


def higher_is_better(metric_name: str) -> bool:
    """True for accuracy and R², False for loss, RMSE and MAE; a ``val_`` or ``test_`` prefix is
    allowed (``val_rmse``). An unknown name raises ``ValueError`` naming it."""
    name = metric_name.removeprefix("val_").removeprefix("test_")
    if name not in _HIGHER_IS_BETTER:
        raise ValueError(f"unknown metric {metric_name!r}: expected one of {sorted(_HIGHER_IS_BETTER)} "
                         "(optionally prefixed by 'val_' or 'test_')")
    return _HIGHER_IS_BETTER[name]


def regression_metrics(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """RMSE and MAE over every value, R² averaged over the targets (scikit-learn's
    ``uniform_average``; a constant target scores 1.0 when predicted exactly, else 0.0)."""
    pred = np.asarray(pred, np.float64).reshape(len(pred), -1)
    true = np.asarray(true, np.float64).reshape(len(true), -1)
    if pred.shape != true.shape or not len(true):
        raise ValueError(f"predictions {pred.shape} and targets {true.shape} must have one equal, non-empty shape")
    err = pred - true
    residual = (err ** 2).sum(axis=0)
    total = ((true - true.mean(axis=0)) ** 2).sum(axis=0)
    r2 = np.where(total > 0, 1 - residual / np.where(total > 0, total, 1), (residual == 0).astype(np.float64))
    return {"rmse": float(np.sqrt((err ** 2).mean())), "mae": float(np.abs(err).mean()), "r2": float(r2.mean())}
