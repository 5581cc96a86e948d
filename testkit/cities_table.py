"""A generated table of the kind a user brings: a text column and a large-scale number, both with
missing values, and a noise column (the DAG test of table preprocessing and benchmark Q3)."""
from __future__ import annotations

import numpy as np
import pandas as pd

# Raw rows the train split never had: a city it never saw, missing values in every column.
UNSEEN_ROWS = {"income": [90_000.0, None, 40_000.0, 41_000.0], "noise": [0.0, 0.0, None, 0.0],
               "city": ["oslo", "pune", "atlantis", None]}


def cities_table(n: int = 900, seed: int = 3) -> pd.DataFrame:
    """The class follows the city and a large-scale number; a second number is noise."""
    rng = np.random.default_rng(seed)
    city = rng.choice(["oslo", "lima", "pune", "kyiv"], n)
    income = rng.normal(50_000, 15_000, n)
    label = np.where(np.isin(city, ["oslo", "lima"]), "north", "south")
    label = np.where(income > 65_000, "rich", label)
    frame = pd.DataFrame({"income": income, "noise": rng.normal(0, 1e-3, n), "city": city, "label": label})
    frame.loc[rng.choice(n, 40, replace=False), "income"] = np.nan
    frame.loc[rng.choice(n, 30, replace=False), "city"] = None
    return frame
