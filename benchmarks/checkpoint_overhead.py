"""Checkpoint overhead: how long the training loop is blocked, upload throughput, restore time.

    .venv/bin/python benchmarks/checkpoint_overhead.py          # quick (about a minute)
    .venv/bin/python benchmarks/checkpoint_overhead.py --full   # more steps, 3 repeats

Starts its own SeaweedFS (``infra.services.start_s3`` on free ports in a temp folder) and trains
an MLP of 3.8 M parameters (15 MB; with Adam's two moments, 45 MB of params + states per
checkpoint) in one process with the worker's own pieces (``make_trainer`` on a local kvstore,
``checkpoint_state.snapshot``, ``Checkpointer``, ``CheckpointStore``), checkpointing every few
steps, once with the synchronous writer and once with the asynchronous one.

- P2: fraction of the loop's wall time blocked by checkpointing (snapshot + serialise/upload for
  sync; snapshot + waits for async), and the end-to-end slowdown against no checkpoints.
- P3: checkpoint upload throughput (``store.save``: serialise + sha256 + put + manifest) ÷ a raw
  boto3 ``put_object`` of the same bytes to the same server.
- Restore: ``store.latest()`` (list, read, verify) + loading params and optimizer state.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def _train(mx, steps: int, every: int, writer, store_prefix: str | None) -> dict:
    from training import checkpoint_state as cs
    from training.kvstore_sync import make_trainer

    mx.random.seed(1)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(2048, activation="relu", in_units=64),
            mx.gluon.nn.Dense(1792, activation="relu", in_units=2048), mx.gluon.nn.Dense(10, in_units=1792))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = make_trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, mx.kv.create("local"),
                           "workers", batch_size=32)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(0)
    X = mx.nd.array(rng.standard_normal((32, 64)))
    y = mx.nd.array(rng.integers(0, 10, 32))
    blocked = 0.0
    started = time.monotonic()
    for step in range(1, steps + 1):
        with mx.autograd.record():
            loss = loss_fn(net(X), y)
        loss.backward()
        trainer.step(32)
        loss.mean().asscalar()
        if writer is not None and step % every == 0:
            t0 = time.monotonic()
            if not writer.busy or step == steps:
                snap = cs.snapshot(net, trainer, step, {"global_step": step})
                writer.stats.blocked_s += time.monotonic() - t0
                writer.submit(snap, must=step == steps)
            else:
                writer.stats.skipped += 1
    if writer is not None:
        t0 = time.monotonic()
        writer.close()
        writer.stats.blocked_s += time.monotonic() - t0
        blocked = writer.stats.blocked_s
    wall = time.monotonic() - started
    out = {"wall_s": wall, "blocked_s": blocked, "blocked_fraction": blocked / wall}
    if writer is not None:
        out.update(writer.stats.as_dict())
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true")
    args = parser.parse_args()
    steps, every, repeats = (200, 10, 3) if args.full else (60, 10, 1)

    from common import storage
    from common.mx import import_mxnet
    from infra.services import StackConfig, stack_env, start_s3, stop_s3
    from training import checkpoint_state as cs
    from training.checkpoint import CheckpointStore
    from training.checkpoint_async import Checkpointer

    mx = import_mxnet()
    with tempfile.TemporaryDirectory(prefix="mxpipe-bench-") as tmp:
        cfg = StackConfig.with_free_ports(tmp)
        cfg.save()
        handle = start_s3(cfg)
        try:
            for k, v in stack_env(cfg.home).items():
                if k.startswith("AWS_"):
                    os.environ[k] = v
            os.environ.pop("AWS_ENDPOINT_URL", None)
            root = f"s3://{cfg.bucket}/bench-{int(time.time())}"
            results: dict[str, list] = {"none": [], "sync": [], "async": []}
            for r in range(repeats):
                results["none"].append(_train(mx, steps, every, None, None))
                for mode in ("sync", "async"):
                    store = CheckpointStore(storage.join(root, f"{mode}-{r}"), keep=2)
                    writer = Checkpointer(store, asynchronous=mode == "async")
                    results[mode].append(_train(mx, steps, every, writer, store.prefix))

            # P3 + restore on the last async store's newest checkpoint.
            store = CheckpointStore(storage.join(root, f"async-{repeats - 1}"), keep=2)
            ckpt = store.latest()
            files = {n: d for n, d in ckpt.files.items()}
            nbytes = sum(len(d) for d in files.values())
            blob = b"".join(files.values())
            client = storage.s3_client()
            bucket, key = storage.split_s3(storage.join(root, "raw", "blob"))
            raw, ours, restore = [], [], []
            for i in range(3):
                t0 = time.monotonic()
                client.put_object(Bucket=bucket, Key=f"{key}-{i}", Body=blob)
                raw.append(time.monotonic() - t0)
                bench = CheckpointStore(storage.join(root, f"p3-{i}"), keep=2)
                t0 = time.monotonic()
                bench.save(100, files, ckpt.state)
                ours.append(time.monotonic() - t0)
                t0 = time.monotonic()
                got = bench.latest()
                restore.append(time.monotonic() - t0)
                assert got is not None
            # Loading into a model + trainer, timed once.
            from training.kvstore_sync import make_trainer

            net = mx.gluon.nn.HybridSequential()
            net.add(mx.gluon.nn.Dense(2048, activation="relu", in_units=64),
                    mx.gluon.nn.Dense(1792, activation="relu", in_units=2048), mx.gluon.nn.Dense(10, in_units=1792))
            net.initialize()
            t0 = time.monotonic()
            cs.load_params(net, got.files[cs.PARAMS], mx.cpu())
            trainer = make_trainer(net.collect_params(), "adam", {"learning_rate": 1e-3}, mx.kv.create("local"),
                                   "workers", batch_size=32)
            cs.load_states(trainer, got.files.get(cs.STATES), got.uri)
            load_s = time.monotonic() - t0
        finally:
            stop_s3(handle)

    def med(xs):
        return float(np.median(xs))

    none_wall = med([x["wall_s"] for x in results["none"]])
    summary = {
        "steps": steps, "checkpoint_every": every, "repeats": repeats, "checkpoint_mb": nbytes / 1e6,
        "no_checkpoint_wall_s": none_wall,
        **{f"{m}_{k}": med([x[k] for x in results[m]]) for m in ("sync", "async")
           for k in ("wall_s", "blocked_s", "blocked_fraction", "committed", "skipped")},
        "sync_slowdown": med([x["wall_s"] for x in results["sync"]]) / none_wall - 1,
        "async_slowdown": med([x["wall_s"] for x in results["async"]]) / none_wall - 1,
        "raw_put_MBps": nbytes / 1e6 / med(raw), "checkpoint_save_MBps": nbytes / 1e6 / med(ours),
        "p3_ratio": med(raw) / med(ours), "restore_read_verify_s": med(restore), "restore_load_s": load_s,
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
