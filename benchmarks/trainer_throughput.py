"""P1 and P5: the pipeline trainer's throughput against a bare Gluon loop, and its scaling.

    .venv/bin/python benchmarks/trainer_throughput.py --quick [--json OUT]   # a few minutes
    .venv/bin/python benchmarks/trainer_throughput.py                         # 3 rounds

One dataset (synthetic 1x28x28 "images", 10 classes, sharded once by ``shard_dataset`` into
2 train shards) and one model (``lenet``: two 3x3 convolutions, Dense 128; Adam, batch 64),
so that a step is compute (tens of ms), not Python overhead.

- P1: the real trainer (``training.loop.worker`` under its detached supervisor: a ``local`` kvstore job,
  1 worker with 2 threads) ÷ a bare Gluon loop over the same rows, model, optimizer, kvstore
  and threads in a process of its own (``--bare-child``). Both report their steady state: the
  median over epochs after the first of samples / loop time per epoch (the worker's epoch
  record ``samples_per_s_total``; the bare loop times the same way, with one ``waitall`` at the end of
  each epoch and no per-step sync, the fastest a plain loop gets). Same work per step on both
  sides: numpy rows → ``nd.array``, forward/backward, ``trainer.step``, and the loss summed on
  the device for the epoch's train loss (the bare loop did not compute it before 2026-12-03).
- Denormals: every role flushes them to zero (``cluster.flush_denormals``, ``common.fpmode``)
  and the bare loop above does too, so P1 compares the same arithmetic. A third run, the bare
  loop with IEEE denormals (what plain Gluon does), gives what flushing is worth on this job:
  Adam's first moments of dead units go denormal after a few hundred steps.
- P5: a 2-worker ``dist_sync`` job (1 server, 1 thread per role, optimizer on the workers,
  the pipeline's default) ÷ the single-process job above, on the same 2 cores. Aggregate =
  rank 0's rate × 2: ``dist_sync`` workers move in lock-step with equal batches.

Rounds alternate pipeline and bare runs, so that the load of a shared machine falls on both;
the best round of each is kept (the least disturbed). Process start, imports, data fetch,
the first epoch (graph build, kvstore init) and evaluation are outside every figure.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from testkit import REPO  # noqa: E402

import numpy as np  # noqa: E402

from testkit.result_file import write_json  # noqa: E402
from common import storage  # noqa: E402
from common.config import CheckpointConfig, ClusterConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig  # noqa: E402

SHAPE = (1, 28, 28)
CLASSES = 10
BATCH = 64
SINGLE_THREADS = 2  # the whole machine, as the two workers of the dist job have together
BARE_TIMEOUT_S = 900.0


def _config(source: str, epochs: int, cluster: dict[str, Any]) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(source_uri=source, input_shape=SHAPE, num_shards=2, drift_action="off"),
        model=ModelConfig(name="lenet", hidden=(128,)),
        optim=OptimConfig(optimizer="adam", learning_rate=0.001, batch_size=BATCH, epochs=epochs),
        cluster=ClusterConfig(**{"job_timeout_s": 1800.0, **cluster}),
        # Only the epoch-end checkpoint, which lies outside the timed loop.
        checkpoint=CheckpointConfig(every_n_steps=10**9, async_upload=True))


SINGLE = {"kvstore": "local", "num_workers": 1, "threads_per_role": SINGLE_THREADS}
DIST = {"kvstore": "dist_sync", "num_workers": 2, "num_servers": 1, "threads_per_role": 1,
        "optimizer_on": "workers"}


def _source(root: str, rows: int) -> str:
    """A learnable image table: a class-dependent blob plus uniform noise, pixels in [0, 1]."""
    import pandas as pd

    rng = np.random.default_rng(0)
    y = rng.integers(0, CLASSES, rows)
    grid = np.indices(SHAPE[1:]).reshape(2, -1).T  # (784, 2) pixel coordinates
    centres = rng.uniform(4, 24, (CLASSES, 2))
    blob = np.exp(-((grid[None] - centres[:, None]) ** 2).sum(-1) / 18.0)  # (classes, 784)
    X = np.clip(0.6 * blob[y] + 0.4 * rng.uniform(size=(rows, grid.shape[0])), 0, 1).astype(np.float32)
    frame = pd.DataFrame(X, columns=[f"p{i}" for i in range(X.shape[1])])
    frame["label"] = y
    uri = os.path.join(root, "images.csv")
    frame.to_csv(uri, index=False, float_format="%.4f")
    return uri


def _steady(rates: list[float]) -> float:
    # The first epoch carries graph building and the kvstore's first pulls.
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def run_pipeline(root: str, cfg: TrainConfig, shards: str, label: str) -> dict[str, Any]:
    from testkit.local_jobs import run_local
    from training.launch.job import JobSpec

    prefix = tempfile.mkdtemp(prefix=f"{label}-", dir=root)
    job = JobSpec(config=cfg, shards_prefix=shards, checkpoint_prefix=os.path.join(prefix, "ckpt"),
                  model_prefix=os.path.join(prefix, "model"), metrics_uri=os.path.join(prefix, "metrics.json"))
    # Started as every run is (a detached supervisor on a local cluster); nothing may be left.
    run_local(job, os.path.join(prefix, "job.json"), os.path.join(prefix, "home"))
    history = json.loads(storage.get_bytes(job.metrics_uri))["history"]
    return {"samples_per_s": _steady([h["samples_per_s_total"] for h in history]),
            "epochs": [round(h["samples_per_s_total"], 1) for h in history],
            "val_accuracy": history[-1].get("val_accuracy")}


def run_bare(root: str, cfg: TrainConfig, shards: str) -> dict[str, Any]:
    """The bare loop in a child process with the worker's thread settings and floating-point
    mode (``cluster.flush_denormals``)."""
    spec = os.path.join(root, "bare.json")
    out = os.path.join(root, "bare-out.json")
    with open(spec, "w") as fh:
        json.dump({"config": cfg.to_dict(), "shards": shards, "out": out}, fh)
    threads = str(cfg.cluster.threads_per_role)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MXNET_CPU_WORKER_NTHREADS": threads,
           "PYTHONPATH": REPO}
    # start_new_session: the child is its own process group, so a timeout stops all of it.
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--bare-child", spec], env=env,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=BARE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
        raise RuntimeError(f"bare loop did not finish in {BARE_TIMEOUT_S:.0f} s") from None
    if rc != 0:
        raise RuntimeError(f"bare loop exited {rc}")
    with open(out) as fh:
        rates = json.load(fh)["epochs"]
    return {"samples_per_s": _steady(rates), "epochs": [round(r, 1) for r in rates]}


def bare_child(spec_path: str) -> None:
    """What a person writes with Gluon alone: same rows, model, optimizer and kvstore."""
    from common import fpmode
    from common.manifest import load_manifest
    from common.mx import import_mxnet
    from training.feed import data
    from training.loop.model import build_model

    with open(spec_path) as fh:
        spec = json.load(fh)
    cfg = TrainConfig.from_dict(spec["config"])
    if cfg.cluster.flush_denormals:
        fpmode.flush_denormals()  # what a role does before mxnet starts its threads
    mx = import_mxnet()
    manifest = load_manifest(spec["shards"])
    with tempfile.TemporaryDirectory() as work:
        X, y = data.fetch_split(manifest, spec["shards"], data.train_shards(manifest), work)
    mx.random.seed(cfg.seed)
    net = build_model(cfg, manifest["num_classes"])
    net.initialize(mx.init.Xavier())
    net.hybridize()
    o = cfg.optim
    trainer = mx.gluon.Trainer(net.collect_params(), o.optimizer, {"learning_rate": o.learning_rate},
                               kvstore=mx.kv.create(cfg.cluster.kvstore), update_on_kvstore=False)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    steps = data.steps_per_epoch(manifest, 1, o.batch_size)
    rng = np.random.default_rng(cfg.seed)
    rates = []
    for _ in range(o.epochs):
        order = np.resize(rng.permutation(len(y)), steps * o.batch_size)
        losses = []  # the epoch's mean loss, as the worker records it: summed on the device
        started = time.monotonic()
        for step in range(steps):
            idx = order[step * o.batch_size:(step + 1) * o.batch_size]
            xb, yb = mx.nd.array(X[idx]), mx.nd.array(y[idx])
            with mx.autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(o.batch_size)
            losses.append(loss.sum())
        mx.nd.waitall()
        train_loss = float(mx.nd.concat(*losses, dim=0).sum().asscalar()) / (steps * o.batch_size)
        rates.append(steps * o.batch_size / (time.monotonic() - started))
        if not np.isfinite(train_loss):
            raise RuntimeError(f"bare loop: loss is {train_loss}")
    with open(spec["out"], "w") as fh:
        json.dump({"epochs": rates}, fh)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 rounds instead of 3")
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--bare-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bare_child:
        bare_child(args.bare_child)
        return 0
    logging.basicConfig(level=logging.WARNING)
    # 256 steps an epoch, 6 epochs: the IEEE bare loop's moments turn denormal from about step
    # 800, so the median of epochs 1-5 falls in that phase.
    rows, epochs, rounds = (16384, 6, 2) if args.quick else (16384, 6, 3)
    from data_checks.shard import shard_dataset

    runs: dict[str, list[dict[str, Any]]] = {"pipeline": [], "bare": [], "bare_ieee": [], "dist": []}
    with tempfile.TemporaryDirectory(prefix="throughput-") as root:
        source = _source(root, rows)
        single_cfg = _config(source, epochs, SINGLE)
        shards = os.path.join(root, "shards")
        shard_dataset(single_cfg, shards)
        ieee_cfg = single_cfg.replace(cluster={"flush_denormals": False})
        for r in range(rounds):
            # Alternating order within a round too, so neither side always runs first.
            sides = [("pipeline", lambda: run_pipeline(root, single_cfg, shards, "single")),
                     ("bare", lambda: run_bare(root, single_cfg, shards)),
                     ("bare_ieee", lambda: run_bare(root, ieee_cfg, shards))]
            for name, fn in (sides if r % 2 == 0 else sides[::-1]):
                runs[name].append(fn())
            runs["dist"].append(run_pipeline(root, _config(source, epochs, DIST), shards, "dist"))
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]['samples_per_s']:.0f}"
                                                          for k, v in runs.items()), file=sys.stderr, flush=True)
    best = {k: max(v, key=lambda x: x["samples_per_s"]) for k, v in runs.items()}
    pipeline, bare, ieee, dist = (best[k]["samples_per_s"] for k in ("pipeline", "bare", "bare_ieee", "dist"))
    result = {"ratio": pipeline / bare, "pipeline_samples_per_s": pipeline, "bare_samples_per_s": bare,
              "p5_ratio": dist / pipeline, "dist_samples_per_s": dist, "single_samples_per_s": pipeline,
              "bare_ieee_samples_per_s": ieee, "flush_gain": bare / ieee,
              # The load of a shared machine moves whole rounds: each round's own ratio too.
              "round_ratios": [p["samples_per_s"] / b["samples_per_s"] for p, b in zip(runs["pipeline"], runs["bare"])],
              "model": "lenet 1x28x28 (conv20, conv50, dense128), adam, batch 64 per worker",
              "rows": rows, "epochs": epochs, "rounds": runs, "load_average": os.getloadavg()}
    print(f"P1 pipeline {pipeline:.0f} ÷ bare {bare:.0f} samples/s = {pipeline / bare:.3f} (goal ≥ 0.98)")
    print("P1 round by round: " + ", ".join(f"{x:.3f}" for x in result["round_ratios"]))
    print(f"denormals flushed: bare {bare:.0f} ÷ bare with IEEE denormals {ieee:.0f} samples/s = {bare / ieee:.3f}")
    print(f"P5 dist_sync 2 workers {dist:.0f} ÷ single {pipeline:.0f} samples/s = {dist / pipeline:.3f} "
          "(goal ≥ 0.95)")
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
