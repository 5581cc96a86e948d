"""Throughput of the pipeline's training job in each kvstore mode, on this machine.

The same job every time (the ``digits`` recipe: MLP 128-64 on sklearn's digits, batch 32 per
worker) runs as every job does (scheduler, servers and workers under a detached supervisor)
with shards, checkpoints and the model in a temp folder. Throughput is the job's own figure:
samples per second per worker inside the training loop (checkpoints and evaluation included),
times the number of workers. One run per mode; prints a table and the chosen mode's ratio to
the fastest distributed mode.

    .venv/bin/python benchmarks/kvstore_modes.py [--epochs 20] [--workers 2] [--modes a,b]

Modes: the offered ones, plus ``NaiveEngine`` on every role (the serial engine, the other way
to avoid the dist_sync race; shown for its cost) and a 1-worker ``local`` job as a baseline.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit.result_file import write_json  # noqa: E402
from common import storage  # noqa: E402
from data_checks.shard import shard_dataset  # noqa: E402
from common.config import TrainConfig, recipe  # noqa: E402
from training.launch.job import JobSpec  # noqa: E402
from testkit.digits import digits_csv  # noqa: E402
from testkit.local_jobs import run_local  # noqa: E402

CHOSEN = "dist_sync/workers"


def modes(workers: int) -> list[tuple[str, dict, dict]]:
    """(label, cluster overrides, extra role env)."""
    naive = {"MXNET_ENGINE_TYPE": "NaiveEngine"}
    return [
        ("dist_sync/workers", {"kvstore": "dist_sync", "optimizer_on": "workers", "num_workers": workers}, {}),
        ("dist_sync/servers", {"kvstore": "dist_sync", "optimizer_on": "servers", "num_workers": workers}, {}),
        ("dist_async/servers", {"kvstore": "dist_async", "optimizer_on": "servers", "num_workers": workers}, {}),
        ("dist_sync/workers+NaiveEngine", {"kvstore": "dist_sync", "optimizer_on": "workers",
                                           "num_workers": workers}, naive),
        ("local (1 worker, baseline)", {"kvstore": "local", "optimizer_on": "workers", "num_workers": 1}, {}),
    ]


def _source(root: str) -> str:
    uri = os.path.join(root, "digits.csv")
    storage.put_bytes(uri, digits_csv())
    return uri


def run_mode(root: str, source: str, label: str, cluster: dict, env: dict, epochs: int) -> dict:
    base = recipe("digits", source)
    cfg: TrainConfig = base.replace(optim={"epochs": epochs}, checkpoint={"every_n_steps": 100000},
                                    cluster={**cluster, "job_timeout_s": 900.0})
    prefix = os.path.join(root, label.split(" ")[0].replace("/", "-").replace("+", "-"))
    shards = os.path.join(prefix, "shards")
    shard_dataset(cfg, shards)
    job = JobSpec(config=cfg, shards_prefix=shards, checkpoint_prefix=os.path.join(prefix, "ckpt"),
                  model_prefix=os.path.join(prefix, "model"), metrics_uri=os.path.join(prefix, "metrics.json"))
    started = time.monotonic()
    run_local(job, os.path.join(prefix, "job.json"), os.path.join(prefix, "home"), env)
    wall = time.monotonic() - started
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    return {"mode": label, "workers": metrics["num_workers"],
            "samples_per_s": metrics["samples_per_s_worker"] * metrics["num_workers"],
            "job_wall_s": wall, "val_accuracy": metrics["history"][-1].get("val_accuracy")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--modes", default="", help="comma-separated labels to run (default: all)")
    p.add_argument("--json", help="also write the result to this file")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvbench-") as root:
        source = _source(root)
        # Untimed 1-epoch job first: the first job on a cold machine pays for page cache and
        # imports, which would otherwise be charged to whichever mode runs first.
        run_mode(os.path.join(root, "warmup"), source, "warmup", modes(args.workers)[0][1], {}, 1)
        wanted = [m for m in args.modes.split(",") if m]
        for label, cluster, env in modes(args.workers):
            if wanted and label.split(" ")[0] not in wanted:
                continue
            rows.append(run_mode(root, source, label, cluster, env, args.epochs))
            print(f"  {label}: {rows[-1]['samples_per_s']:.0f} samples/s", file=sys.stderr, flush=True)
    dist = [r for r in rows if r["workers"] > 1]
    fastest = max(dist, key=lambda r: r["samples_per_s"])
    chosen = next((r for r in rows if r["mode"] == CHOSEN), fastest)
    print(f"\n{'mode':32s} {'workers':>7s} {'samples/s':>10s} {'÷ fastest':>9s} {'job s':>6s} {'val acc':>7s}")
    for r in rows:
        acc = r["val_accuracy"]
        print(f"{r['mode']:32s} {r['workers']:7d} {r['samples_per_s']:10.0f} "
              f"{r['samples_per_s'] / fastest['samples_per_s']:9.2f} {r['job_wall_s']:6.1f} "
              f"{acc if acc is None else f'{acc:.3f}':>7}")
    ratio = chosen["samples_per_s"] / fastest["samples_per_s"]
    print(f"\nchosen mode {CHOSEN}: {ratio:.2f} of the fastest distributed mode ({fastest['mode']})")
    result = {"chosen": CHOSEN, "ratio_to_fastest": ratio, "fastest": fastest["mode"], "rows": rows}
    print(json.dumps(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
