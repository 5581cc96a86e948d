"""scikit-learn's digits (1797 rows, 64 pixel columns) as the pipeline's source table: the frame,
and the CSV bytes every test and benchmark uploads as its dataset."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd


def digits_frame(copies: int = 1, seed: int = 0) -> pd.DataFrame:
    """``pixel_0`` … ``pixel_63`` and ``label``; ``copies`` > 1 appends jittered copies (Gaussian
    noise of 0.5, ``seed``) after the original rows, for a longer epoch."""
    import numpy as np
    import pandas as pd
    from sklearn.datasets import load_digits

    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    digits = load_digits()
    rng = np.random.default_rng(seed)
    parts = [digits.data if i == 0 else digits.data + rng.normal(0, 0.5, digits.data.shape) for i in range(copies)]
    frame = pd.DataFrame(np.vstack(parts), columns=[f"pixel_{i}" for i in range(digits.data.shape[1])])
    frame["label"] = np.tile(digits.target, copies)
    return frame


def digits_csv(copies: int = 1, seed: int = 0) -> bytes:
    """``digits_frame`` as CSV (no index)."""
    return digits_frame(copies, seed).to_csv(index=False).encode()
