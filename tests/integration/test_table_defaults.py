"""The defaults a DAG run gives a user's table train a good model: a nonlinear regression table
with features on scales from 0.01 to 1000 and a target around 5000, given only its label column
and ``model.task='regression'``, trained as a real job (2 ``dist_sync`` workers), scored on its
raw test rows by the exported model as the registry serves it.

The bound is measured, with a margin: at this size the defaults reach a test R² of 0.927 (79
epochs, the best at 68; a scaled scikit-learn MLP on the same split: 0.925); the defaults of
before (20 epochs at a constant rate, no early stopping, raw targets) reached -0.02.
``benchmarks/table_defaults.py`` measures the full size and the classification table against
scikit-learn. About 70 s in all on two cores (40 s of it the job).
"""
from __future__ import annotations

import pytest

from testkit.default_runs import train_and_score
from testkit.scaled_tables import TARGET, scaled_regression_table

pytestmark = pytest.mark.integration

ROWS = 2000
MIN_R2 = 0.88


def test_the_defaults_fit_a_regression_table_with_features_on_very_different_scales(tmp_path):
    scores = train_and_score(scaled_regression_table(ROWS), TARGET, "regression", str(tmp_path), reference=False)
    assert scores.pipeline >= MIN_R2, scores
    assert scores.best_epoch is not None, scores  # early stopping on: the best epoch tracked and exported
