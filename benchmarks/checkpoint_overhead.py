"""Checkpoint overhead: how long the training loop is blocked, upload throughput, restore time.

    .venv/bin/python benchmarks/checkpoint_overhead.py          # quick (about two minutes)
    .venv/bin/python benchmarks/checkpoint_overhead.py --full   # more steps, 3 repeats
    .venv/bin/python benchmarks/checkpoint_overhead.py --repeats 2 --s3-nice   # S3 server at nice 19

Starts its own SeaweedFS (``infra.s3_service.start_s3`` on free ports in a temp folder) and trains
ResNet-18 (``gluon.model_zoo.vision.resnet18_v1``, 11.2 M parameters, 45 MB; with SGD
momentum, 90 MB of params + states per checkpoint) on 32x32 inputs in one process with the
worker's own pieces (``make_trainer`` on a local kvstore, ``checkpoint_state.snapshot``,
``CheckpointManager`` with its ``CheckpointUploader``, ``CheckpointStore``), checkpointing every few
steps: once without checkpoints, once with the synchronous writer and once with the asynchronous one.

- P2: fraction of the loop's wall time blocked by checkpointing in steady state (the snapshot
  plus any wait for the previous upload; sync: the whole serialise + upload), the one-off wait
  for the last upload at the end of the job (reported apart: it is paid once per job, not per
  save), and the end-to-end cost per save in steps against the run without checkpoints.
- P3: checkpoint upload throughput (``store.save``: serialise + sha256 + put + manifest) ÷ a raw
  boto3 ``put_object`` of the same bytes to the same server.
- Restore: ``store.latest()`` (list, read, verify) + loading params and optimizer state.
- Where the end-to-end cost goes: CPU seconds of this process and of the S3 server in each mode.
  Here the server shares the training machine's cores (it used about 1.4 CPU-s per 90 MB save),
  which a remote S3 does not; ``--s3-nice`` runs it at nice 19, a stand-in for "elsewhere".
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import psutil  # noqa: E402

from testkit.result_file import write_json  # noqa: E402

BATCH = 16
# Side by side in one run: no checkpoints, the synchronous writer, the asynchronous one.
MODES = ("none", "sync", "async")
OPTIMIZER = ("sgd", {"learning_rate": 0.01, "momentum": 0.9})


def _model(mx):
    net = mx.gluon.model_zoo.vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((1, 3, 32, 32)))  # materialise deferred shapes
    return net


def _train(mx, steps: int, every: int, store, asynchronous: bool = True) -> dict:
    """``steps`` steps, as one epoch; with a ``store``, checkpointed every ``every`` steps and at the end."""
    from common.config import CheckpointConfig
    from training.checkpoint import state as cs
    from training.checkpoint.manager import CheckpointManager
    from training.loop.kvstore_sync import make_trainer

    mx.random.seed(1)
    net = _model(mx)
    trainer = make_trainer(net.collect_params(), OPTIMIZER[0], dict(OPTIMIZER[1]), mx.kv.create("local"),
                           "workers", batch_size=BATCH)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    X = mx.nd.random.uniform(shape=(BATCH, 3, 32, 32))
    y = mx.nd.array(np.arange(BATCH) % 10)
    ckpts = None
    if store is not None:
        ckpts = CheckpointManager(store, CheckpointConfig(every_n_steps=every, async_upload=asynchronous), steps,
                                  lambda step: cs.snapshot(net, trainer, step, {"global_step": step}))
    started = time.monotonic()
    for step in range(1, steps + 1):
        with mx.autograd.record():
            loss = loss_fn(net(X), y)
        loss.backward()
        trainer.step(BATCH)
        loss.mean().asscalar()
        # What the worker does: a periodic save is skipped while one is in flight; the epoch's
        # last one must exist and waits.
        if ckpts is not None and (step == steps or ckpts.due(step, step, time.monotonic())):
            ckpts.save(step, must=step == steps)
    loop_wall = time.monotonic() - started
    out: dict = {"wall_s": loop_wall, "steps": steps}
    if ckpts is not None:
        steady_blocked = ckpts.stats.blocked_s
        t0 = time.monotonic()
        out.update(ckpts.finish(steps))
        flush = time.monotonic() - t0
        out.update({"blocked_s": steady_blocked, "blocked_fraction": steady_blocked / loop_wall,
                    "final_flush_s": flush})
    return out


def _cpu_seconds(s3_pid: int) -> dict[str, float]:
    """CPU time of this process and of the S3 server (which, unlike here, is not on the training
    machine in production): where the end-to-end cost of a save goes."""
    cpu = psutil.Process(s3_pid).cpu_times()
    return {"trainer": time.process_time(), "s3_server": cpu.user + cpu.system}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--json", help="also write the summary to this file")
    parser.add_argument("--repeats", type=int, help="rounds of every mode (default 1; --full 3)")
    parser.add_argument("--s3-nice", action="store_true", help="run the S3 server at nice 19")
    args = parser.parse_args()
    steps, every, repeats = (200, 10, 3) if args.full else (60, 10, 1)
    repeats = args.repeats or repeats

    from common import storage
    from common.mx import import_mxnet
    from infra.s3_service import start_s3, stop_s3
    from infra.stack_config import StackConfig, stack_env
    from training.checkpoint import state as cs
    from training.checkpoint.store import CheckpointStore

    mx = import_mxnet()
    with tempfile.TemporaryDirectory(prefix="mxpipe-bench-") as tmp:
        cfg = StackConfig.with_free_ports(tmp)
        cfg.save()
        handle = start_s3(cfg)
        try:
            if args.s3_nice:  # every thread of every process in its group (Linux: nice is per thread)
                os.setpriority(os.PRIO_PGRP, handle.pgid, 19)
            for k, v in stack_env(cfg.home).items():
                if k.startswith("AWS_"):
                    os.environ[k] = v
            os.environ.pop("AWS_ENDPOINT_URL", None)
            root = f"s3://{cfg.bucket}/bench-{int(time.time())}"
            results: dict[str, list] = {m: [] for m in MODES}
            _train(mx, 3, every, None)  # warm-up: first-step graph building is not a cost of checkpoints
            for r in range(repeats):
                for mode in MODES:
                    store = None if mode == "none" else CheckpointStore(storage.join(root, f"{mode}-{r}"), keep=2)
                    cpu = _cpu_seconds(handle.pid)
                    results[mode].append(_train(mx, steps, every, store, asynchronous=mode != "sync"))
                    results[mode][-1].update({f"{k}_cpu_s": v - cpu[k] for k, v in _cpu_seconds(handle.pid).items()})

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
            from training.loop.kvstore_sync import make_trainer

            net = _model(mx)
            t0 = time.monotonic()
            cs.load_params(net, got.files[cs.PARAMS], mx.cpu())
            trainer = make_trainer(net.collect_params(), OPTIMIZER[0], dict(OPTIMIZER[1]), mx.kv.create("local"),
                                   "workers", batch_size=BATCH)
            cs.load_states(trainer, got.files.get(cs.STATES), got.uri)
            load_s = time.monotonic() - t0
        finally:
            stop_s3(handle)

    def med(xs):
        return float(np.median(xs))

    none_wall = med([x["wall_s"] for x in results["none"]])
    step_s = none_wall / steps

    modes = MODES[1:]

    def per_save_steps(mode: str, key: str) -> float:
        """Median over repeats of a cost per committed save, in steps of the run without checkpoints."""
        costs = []
        for x in results[mode]:
            saves = max(x["committed"], 1)
            cost = x["wall_s"] - none_wall if key == "slowdown" else x[key]
            costs.append(cost / saves / step_s)
        return med(costs)

    summary = {
        "steps": steps, "checkpoint_every": every, "repeats": repeats, "checkpoint_mb": nbytes / 1e6,
        "s3_nice": 19 if args.s3_nice else 0,
        "no_checkpoint_wall_s": none_wall,
        **{f"{m}_{k}": med([x[k] for x in results[m]]) for m in modes
           for k in ("wall_s", "blocked_s", "blocked_fraction", "committed", "skipped", "final_flush_s")},
        **{f"{m}_{k}_cpu_s": med([x[f"{k}_cpu_s"] for x in results[m]]) for m in MODES for k in ("trainer", "s3_server")},
        "step_s": step_s,
        **{f"{m}_blocked_steps_per_save": per_save_steps(m, "blocked_s") for m in modes},
        **{f"{m}_slowdown_steps_per_save": per_save_steps(m, "slowdown") for m in modes},
        **{f"{m}_slowdown": med([x["wall_s"] for x in results[m]]) / none_wall - 1 for m in modes},
        "raw_put_MBps": nbytes / 1e6 / med(raw), "checkpoint_save_MBps": nbytes / 1e6 / med(ours),
        "p3_ratio": med(raw) / med(ours), "restore_read_verify_s": med(restore), "restore_load_s": load_s,
    }
    print(json.dumps(summary, indent=2))
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
