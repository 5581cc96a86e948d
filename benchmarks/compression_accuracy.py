"""Validation accuracy against the 2-bit compression threshold, beside an uncompressed job.

The job of the table in docs/kvstore-correctness.md ("Accuracy against the threshold"): the
``debug`` recipe (MLP 64-32-10, Adam lr 0.005, batch 32 per worker) on sklearn's digits,
2 dist_sync workers, 1 server, optimizer on the workers, one ``python -m training run`` per
threshold (local shards and output, no services needed). The jobs are deterministic: a rerun
gives the same accuracy.

    .venv/bin/python benchmarks/compression_accuracy.py [--epochs 2] [--thresholds none,0.5,2,8,32,128]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testkit import REPO  # noqa: E402

from data_checks.shard import shard_dataset  # noqa: E402
from benchmarks.kvstore_modes import _source  # noqa: E402
from common.config import recipe  # noqa: E402


def run(root: str, source: str, shards: str, threshold: str, epochs: int) -> dict:
    compression = ({"gradient_compression": "none"} if threshold == "none" else
                   {"gradient_compression": "2bit", "compression_threshold": float(threshold)})
    cfg = recipe("debug", source).replace(optim={"epochs": epochs}, cluster=compression)
    out = os.path.join(root, f"t-{threshold}")
    os.makedirs(out)
    config = os.path.join(out, "config.json")
    with open(config, "w") as fh:
        fh.write(json.dumps(cfg.to_dict()))
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "training", "run", "--config", config, "--shards", shards,
                    "--out", os.path.join(out, "run")], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "run", "metrics", "train.json")) as fh:
        final = json.load(fh)["history"][-1]
    return {"threshold": threshold, "epochs": epochs, "val_accuracy": final["val_accuracy"],
            "train_loss": final["train_loss"], "job_s": time.monotonic() - started}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--thresholds", default="none,0.5,2,8,32,128")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mxpipe-compression-") as root:
        source = _source(root)
        shards = os.path.join(root, "shards")
        shard_dataset(recipe("debug", source), shards)
        for threshold in args.thresholds.split(","):
            rows.append(run(root, source, shards, threshold, args.epochs))
            r = rows[-1]
            print(f"threshold {r['threshold']:>6}  epochs {r['epochs']:>3}  val_accuracy {r['val_accuracy']:.3f}  "
                  f"train_loss {r['train_loss']:.3f}  ({r['job_s']:.0f}s)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
