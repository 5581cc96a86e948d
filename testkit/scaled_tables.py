"""Two generated tables whose features lie on very different scales (0.01 to 1000), as a user's
table often does: a nonlinear regression table whose target is far from zero (mean about 5300, std
about 860), and a three-class classification table. A pure function of (rows, seed), so the
benchmark (``benchmarks/table_defaults.py``) and the test at small size see the same rows.

Each feature is ``scale × u`` with ``u`` standard normal; the target depends on the ``u``s
nonlinearly (products, a sine, a square, a threshold), so a linear model is not enough and an
unscaled network sees inputs 10⁵ apart in size.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

# Feature name → its scale (the standard deviation of the column).
SCALES = {"micro": 0.01, "milli": 0.05, "deci": 0.1, "unit": 1.0, "deca": 10.0, "hecto": 100.0, "kilo": 1000.0,
          "half_kilo": 500.0}
TARGET = "y"
LABEL = "label"


def _latent(rows: int, seed: int) -> tuple[pd.DataFrame, np.ndarray]:
    """The features (scaled) and the standard normal values behind them ``[rows, len(SCALES)]``."""
    u = np.random.default_rng(seed).standard_normal((rows, len(SCALES)))
    frame = pd.DataFrame({name: u[:, j] * scale for j, (name, scale) in enumerate(SCALES.items())})
    return frame, u


def scaled_regression_table(rows: int = 4000, seed: int = 0) -> pd.DataFrame:
    """Features on scales 0.01–1000 and ``y``: a nonlinear function of them plus noise (the noise
    leaves an R² of about 0.98 as the best any model can do), in units where it is about
    5300 ± 860 (measured on 200,000 rows)."""
    frame, u = _latent(rows, seed)
    signal = (1.5 * np.sin(2.0 * u[:, 0]) + u[:, 1] * u[:, 2] + 0.8 * u[:, 3] ** 2 + np.tanh(2.0 * u[:, 4])
              - 0.7 * u[:, 5] * (u[:, 6] > 0) + 0.5 * u[:, 7])
    noise = 0.3 * np.random.default_rng(seed + 1).standard_normal(rows)
    frame[TARGET] = 5000.0 + 400.0 * (signal + noise)
    return frame


def scaled_classification_table(rows: int = 4000, seed: int = 0) -> pd.DataFrame:
    """Features on scales 0.01–1000 and ``label`` in {0, 1, 2}: the tercile of a nonlinear score."""
    frame, u = _latent(rows, seed)
    score = (np.sin(2.0 * u[:, 0]) + u[:, 1] * u[:, 2] + 0.8 * u[:, 3] ** 2 - 0.8 + np.tanh(2.0 * u[:, 4])
             - u[:, 5] * (u[:, 6] > 0) + 0.3 * np.random.default_rng(seed + 1).standard_normal(rows))
    frame[LABEL] = np.digitize(score, np.quantile(score, [1 / 3, 2 / 3])).astype(np.int64)
    return frame
