#!/usr/bin/env python
"""Regression against a scikit-learn reference on the same split: the pipeline's test R² on
scikit-learn's bundled ``diabetes`` table ÷ ``Ridge``'s.

The pipeline's part is what the DAG's shard → train → register steps run, without Airflow: the
table (a local CSV) is sharded with ``model.task='regression'``, a 2-worker ``dist_sync`` job
trains it (``python -m training run``: scheduler, server, workers as local processes), and the
exported model is scored on the test split through the pyfunc code the registered model runs
(``training.tracking.pyfunc_model``). ``Ridge`` (scikit-learn's default alpha=1.0) is fitted on
the rows of the pipeline's own train shards and scored on its test shard, read back from the
shards, so both see exactly the same split. The goal is pipeline R² ≥ Ridge's (ratio ≥ 1).

The features are fed raw (no standardisation; diabetes's columns are already centred and scaled);
the job's settings (MLP 64-32, Adam lr 0.02, batch 32 per worker, 150 epochs) were chosen for
this table. The job is deterministic for a seed.

    .venv/bin/python benchmarks/regression_reference.py [--epochs 150] [--seeds 42] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# Before mxnet is imported anywhere: scikit-learn must stay importable (common.records blocks it).
from sklearn.datasets import load_diabetes
from sklearn.linear_model import Ridge
from sklearn.metrics import r2_score

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (REPO, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

from common.config import TrainConfig  # noqa: E402
from data_checks.shard import shard_dataset  # noqa: E402
from result_file import write_json  # noqa: E402
from training.feed import data as feed_data  # noqa: E402
from training.tracking.pyfunc_model import find_export_files, load_exported  # noqa: E402


def source_csv(root: str) -> str:
    import pandas as pd

    d = load_diabetes()
    frame = pd.DataFrame(d.data, columns=d.feature_names)
    frame["progression"] = d.target
    path = os.path.join(root, "diabetes.csv")
    frame.to_csv(path, index=False)
    return path


def split(manifest: dict, shards: str, name: str, work_dir: str) -> tuple:
    return feed_data.fetch_split(manifest, shards, [s for s in manifest["shards"] if s["split"] == name],
                                 os.path.join(work_dir, name))


def run(root: str, source: str, seed: int, epochs: int) -> dict:
    cfg = TrainConfig.from_dict({
        "data": {"source_uri": source, "label_column": "progression"},
        "model": {"task": "regression", "loss": "l2", "hidden": [64, 32]},
        "optim": {"optimizer": "adam", "learning_rate": 0.02, "batch_size": 32, "epochs": epochs},
        "cluster": {"num_workers": 2, "num_servers": 1, "kvstore": "dist_sync"},
        "checkpoint": {"every_n_steps": 1000}, "seed": seed})
    out = os.path.join(root, f"seed-{seed}")
    shards = os.path.join(out, "shards")
    manifest = shard_dataset(cfg, shards)
    config = os.path.join(out, "config.json")
    with open(config, "w") as fh:
        fh.write(cfg.to_json())
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "training", "run", "--config", config, "--shards", shards,
                    "--out", os.path.join(out, "run")], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    job_s = time.monotonic() - started
    X_train, y_train = split(manifest, shards, "train", out)
    X_test, y_test = split(manifest, shards, "test", out)
    files = find_export_files(os.path.join(out, "run", "model"))
    model = load_exported(files["symbol"], files["params"], files["meta"])
    pipeline_r2 = float(r2_score(y_test, model.predict_values(X_test)))
    ridge_r2 = float(r2_score(y_test, Ridge().fit(X_train, y_train).predict(X_test)))
    with open(os.path.join(out, "run", "metrics", "train.json")) as fh:
        final = json.load(fh)["history"][-1]
    return {"seed": seed, "epochs": epochs, "train_rows": len(X_train), "test_rows": len(X_test),
            "pipeline_test_r2": pipeline_r2, "ridge_test_r2": ridge_r2, "ratio": pipeline_r2 / ridge_r2,
            "final_val_r2": final["val_r2"], "job_s": round(job_s, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--seeds", default="42", help="comma-separated seeds (each its own split and job)")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mxpipe-regression-") as root:
        source = source_csv(root)
        for seed in (int(s) for s in args.seeds.split(",")):
            row = run(root, source, seed, args.epochs)
            rows.append(row)
            print(f"seed {seed}: pipeline test R² {row['pipeline_test_r2']:.4f} vs Ridge {row['ridge_test_r2']:.4f} "
                  f"(ratio {row['ratio']:.3f}; {row['train_rows']} train / {row['test_rows']} test rows; "
                  f"job {row['job_s']:.0f} s)", flush=True)
    result = {"rows": rows, "goal": "pipeline test R² >= Ridge's on the same split",
              "met": all(r["pipeline_test_r2"] >= r["ridge_test_r2"] for r in rows)}
    write_json(args.json, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
