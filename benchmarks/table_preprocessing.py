"""Test accuracy on scikit-learn's bundled ``wine`` table: the pipeline against a scaled linear model.

The pipeline: ``shard_dataset`` (train/validation/test split, standardisation fitted on the
train split, recorded in the manifest), one ``python -m training run`` (2 dist_sync workers,
1 server, the MLP of the ``debug`` recipe; local shards and output, no services needed), then
the exported model with its ``preprocessing.json`` (what the registered pyfunc model loads)
scoring the **raw** test rows. The reference: scikit-learn's ``StandardScaler`` +
``LogisticRegression`` fitted on the same train rows (the train shards' source rows) and scored
on the same test rows. The goal: pipeline accuracy ÷ reference accuracy ≥ 1.0. Deterministic
(seeded): a rerun gives the same figures.

    .venv/bin/python benchmarks/table_preprocessing.py [--epochs 60] [--no-standardize] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (REPO, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

# Before anything imports mxnet (it would block scikit-learn's import, see common/records.py).
from sklearn.datasets import load_wine  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

import numpy as np  # noqa: E402

from common import records  # noqa: E402
from common.config import recipe  # noqa: E402
from common.manifest import download_shard  # noqa: E402
from data_checks.shard import shard_dataset  # noqa: E402
from result_file import write_json  # noqa: E402
from training.tracking import pyfunc_model  # noqa: E402


def split_ids(manifest: dict, shards: str, work: str) -> dict[str, np.ndarray]:
    """Source row numbers of each split."""
    out: dict[str, list[np.ndarray]] = {}
    for shard in manifest["shards"]:
        _, _, ids = records.read_all(*download_shard(manifest, shards, shard["name"], work), manifest["num_features"])
        out.setdefault(shard["split"], []).append(ids)
    return {k: np.sort(np.concatenate(v)) for k, v in out.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--standardize", action=argparse.BooleanOptionalAction, default=True,
                   help="data.standardize (--no-standardize: the features go in raw, as before)")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()
    frame = load_wine(as_frame=True).frame.rename(columns={"target": "label"})
    with tempfile.TemporaryDirectory(prefix="mxpipe-wine-") as root:
        source = os.path.join(root, "wine.csv")
        frame.to_csv(source, index=False)
        cfg = recipe("debug", source).replace(optim={"epochs": args.epochs, "batch_size": 16, "learning_rate": 0.01},
                                              data={"standardize": args.standardize})
        shards = os.path.join(root, "shards")
        manifest = shard_dataset(cfg, shards)
        ids = split_ids(manifest, shards, root)
        config = os.path.join(root, "config.json")
        with open(config, "w") as fh:
            fh.write(cfg.to_json())
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "training", "run", "--config", config, "--shards", shards,
                        "--out", os.path.join(root, "run")], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        job_s = time.monotonic() - started
        files = pyfunc_model.find_export_files(os.path.join(root, "run", "model"))
        loaded = pyfunc_model.load_exported(files["symbol"], files["params"], files["meta"], files.get("preprocessing"))
        test = frame.iloc[ids["test"]]
        raw = test.drop(columns="label")
        predicted = pyfunc_model.predictions_frame(loaded, loaded.predict_proba(loaded.features(raw)))["label"]
        pipeline = float((predicted.to_numpy() == test["label"].to_numpy()).mean())
        train = frame.iloc[ids["train"]]
        reference = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        reference.fit(train.drop(columns="label"), train["label"])
        sklearn = float(reference.score(raw, test["label"]))
    result = {"dataset": "sklearn wine", "train_rows": len(ids["train"]), "test_rows": len(ids["test"]),
              "epochs": args.epochs, "standardize": args.standardize, "pipeline_test_accuracy": pipeline, "sklearn_test_accuracy": sklearn,
              "ratio": pipeline / sklearn, "goal": ">= 1.0", "met": pipeline / sklearn >= 1.0, "job_s": round(job_s, 1)}
    print(json.dumps(result, indent=2))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
