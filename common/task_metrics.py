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


class RegressionSums:
    """``regression_metrics`` over rows that come in chunks (``add``), in memory of the targets'
    count: sums of the errors, and each target's count, mean and sum of squared deviations merged
    chunk by chunk (Chan et al.'s pairwise update, as stable as the two-pass sum)."""

    def __init__(self) -> None:
        self.n = 0
        self.values = 0  # predictions seen (rows × targets)
        self.squared = 0.0
        self.absolute = 0.0
        self.residual: np.ndarray | None = None  # per target: sum of squared errors
        self.mean: np.ndarray | None = None  # per target: mean of the true values
        self.m2: np.ndarray | None = None  # per target: sum of squared deviations from the mean

    def add(self, pred: np.ndarray, true: np.ndarray) -> None:
        pred = np.asarray(pred, np.float64).reshape(len(pred), -1)
        true = np.asarray(true, np.float64).reshape(len(true), -1)
        if pred.shape != true.shape:
            raise ValueError(f"predictions {pred.shape} and targets {true.shape} must have one shape")
        if not len(true):
            return
        err = pred - true
        self.squared += float((err ** 2).sum())
        self.absolute += float(np.abs(err).sum())
        self.values += err.size
        k, mean = len(true), true.mean(axis=0)
        m2 = ((true - mean) ** 2).sum(axis=0)
        if self.mean is None:
            self.residual, self.mean, self.m2 = (err ** 2).sum(axis=0), mean, m2
        else:
            total = self.n + k
            delta = mean - self.mean
            self.m2 = self.m2 + m2 + delta ** 2 * self.n * k / total
            self.mean = self.mean + delta * k / total
            self.residual = self.residual + (err ** 2).sum(axis=0)
        self.n += k

    def metrics(self) -> dict[str, float]:
        """``rmse``, ``mae`` and ``r2`` of every row added (``regression_metrics``' definitions)."""
        if not self.n:
            raise ValueError("no rows to compute regression metrics on")
        total, residual = self.m2, self.residual
        r2 = np.where(total > 0, 1 - residual / np.where(total > 0, total, 1), (residual == 0).astype(np.float64))
        return {"rmse": float(np.sqrt(self.squared / self.values)), "mae": self.absolute / self.values,
                "r2": float(r2.mean())}
