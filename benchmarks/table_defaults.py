#!/usr/bin/env python
"""The defaults on a user's tables: what a DAG run trains when the user sets only the source, the
label column and (regression) ``model.task``, against a scaled scikit-learn MLP on the same split.

Two generated tables (``testkit/scaled_tables.py``, deterministic for ``--rows`` and
``--seed``), features on scales from 0.01 to 1000:

- a nonlinear regression table, target around 5000: test R² of the exported model (raw rows in,
  the target's units out, as the registry serves it) ÷ ``StandardScaler`` + ``MLPRegressor``'s
  (targets scaled too);
- a three-class table: test accuracy ÷ ``StandardScaler`` + ``MLPClassifier``'s;

and the digits table (the demo's), trained with the defaults and with the defaults of before
(20 epochs at a constant rate, no early stopping, no dropout): its job time and test accuracy
under both, so the cost of the epoch budget on the demo is a figure.

Every job is a real local job on the default cluster (2 ``dist_sync`` workers, 1 server),
sharded to a local folder (no S3 or MLflow server): ``testkit/default_runs.py``.

    .venv/bin/python benchmarks/table_defaults.py [--rows 4000] [--seed 0] [--more-seeds 1,2] [--skip-digits]
        [--json OUT]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# Before anything imports mxnet (it would block scikit-learn's import, see common/record_codec.py).
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.neural_network import MLPRegressor  # noqa: E402, F401

import pandas as pd  # noqa: E402

from testkit.result_file import write_json  # noqa: E402
from testkit.default_runs import train_and_score  # noqa: E402
from testkit.scaled_tables import LABEL, TARGET, scaled_classification_table, scaled_regression_table  # noqa: E402

# The defaults of before, as config fields (the digits recipe then; targets were not standardised,
# which no field turns back on: the digits table is a classification one).
BEFORE = {"model": {"dropout": 0.0}, "optim": {"epochs": 20, "lr_schedule": "constant", "early_stopping_patience": 0}}


def digits() -> pd.DataFrame:
    d = load_digits()
    frame = pd.DataFrame(d.data, columns=[f"pixel_{i}" for i in range(d.data.shape[1])])
    frame["label"] = d.target
    return frame


def _run(frame: pd.DataFrame, label: str, task: str, tmp: str, name: str, **kw: Any) -> dict[str, Any]:
    folder = os.path.join(tmp, name)
    os.makedirs(folder)
    row = dataclasses.asdict(train_and_score(frame, label, task, folder, **kw))
    row["train_s"] = round(row["train_s"], 1)
    if row["reference"] == row["reference"]:  # not NaN
        row["ratio"] = row["pipeline"] / row["reference"]
        row["reference_name"] = f"StandardScaler + {'MLPRegressor' if task == 'regression' else 'MLPClassifier'}"
    print(f"{name}: {row['metric']} {row['pipeline']:.4f}"
          + (f" vs {row['reference']:.4f} (ratio {row['ratio']:.3f})" if "ratio" in row else "")
          + f"; {row['epochs_run']} epochs (best {row['best_epoch']}), job {row['train_s']} s", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4000, help="rows of each generated table")
    p.add_argument("--seed", type=int, default=0, help="the generated tables' seed")
    p.add_argument("--more-seeds", default="", help="also generate and score both tables at these seeds "
                   "(comma-separated): one table's test split is a few hundred rows, so a ratio near 1 is "
                   "within its sampling error; the mean over the seeds is reported beside seed --seed's")
    p.add_argument("--skip-digits", action="store_true", help="only the two generated tables")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()
    result: dict[str, Any] = {"rows": args.rows, "seed": args.seed}
    seeds = [args.seed] + [int(s) for s in args.more_seeds.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="mxpipe-table-defaults-") as tmp:
        for seed in seeds:
            rows = {"regression": _run(scaled_regression_table(args.rows, seed), TARGET, "regression", tmp,
                                       f"regression-{seed}"),
                    "classification": _run(scaled_classification_table(args.rows, seed), LABEL, "classification",
                                           tmp, f"classification-{seed}")}
            if seed == args.seed:
                result.update(rows)
            else:
                result.setdefault("more_seeds", {})[str(seed)] = rows
        if not args.skip_digits:
            frame = digits()
            result["digits"] = _run(frame, "label", "classification", tmp, "digits", reference=False)
            result["digits_before"] = _run(frame, "label", "classification", tmp, "digits_before", reference=False,
                                           config=BEFORE)
    if len(seeds) > 1:
        more = result["more_seeds"].values()
        result["mean_ratio"] = {task: statistics.mean([result[task]["ratio"]] + [rows[task]["ratio"] for rows in more])
                                for task in ("regression", "classification")}
    result["met"] = {"regression": result["regression"]["ratio"] >= 1.0,
                     "classification": result["classification"]["ratio"] >= 1.0}
    if not args.skip_digits:
        result["digits_time_ratio"] = result["digits"]["train_s"] / result["digits_before"]["train_s"]
        result["met"]["digits_within_2x"] = result["digits_time_ratio"] <= 2.0
    write_json(args.json, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
