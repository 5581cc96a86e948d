"""One worker of a training job: load → loop {step, maybe checkpoint, maybe evaluate} → export.

Run as a role process by the launcher (``python -m training worker JOB_URI``) with the ps-lite
``DMLC_*`` variables set. Rank 0 is the only writer of checkpoints, metrics and the model.

Optimizer placement (``cluster.optimizer_on``): on the workers by default (gradients summed
through the servers, every worker applies the same step; the state a later change needs for
``Trainer.save_states``), or on the servers (required by ``dist_async``). The trainer comes
from ``training.kvstore_sync.make_trainer``, which syncs the kvstore before the first forward:
gluon's lazy sync inside the first ``step()`` is what made the worker-side optimizer give
wrong models under ``dist_sync`` (DESIGN.md, "Correctness trap"; docs/kvstore-correctness.md).
A resumed job restores parameters, data position and metric history exactly, and restarts the
optimizer state (momentum / Adam moments) from zero.
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import tempfile
import time
from typing import Any

import numpy as np

from common import storage
from common.mx import import_mxnet
from training import data, faults
from training.checkpoint import CheckpointStore
from training.job import JobSpec
from training.kvstore_sync import make_trainer
from training.model import build_model

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0


class NaNLossError(RuntimeError):
    """The loss became NaN or infinite: a deterministic failure, retrying will not help."""


def _optimizer_params(cfg: Any) -> dict[str, Any]:
    # No rescale_grad: trainer.step(global_batch) sets it, and gluon multiplies the two (a
    # rescale_grad of 1/global_batch here made the gradient scale 1/global_batch**2).
    o = cfg.optim
    params: dict[str, Any] = {"learning_rate": o.learning_rate, "wd": o.weight_decay}
    if o.optimizer in ("sgd", "nag"):
        params["momentum"] = o.momentum
    return params


def _params_bytes(net: Any) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.params")
        net.save_parameters(path)
        with open(path, "rb") as fh:
            return fh.read()


def _load_params_bytes(net: Any, blob: bytes, ctx: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.params")
        with open(path, "wb") as fh:
            fh.write(blob)
        net.load_parameters(path, ctx=ctx)


def evaluate(net: Any, X: np.ndarray, y: np.ndarray, batch: int = 512) -> dict[str, float]:
    mx = import_mxnet()
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    total_loss, correct = 0.0, 0
    for i in range(0, len(y), batch):
        xb, yb = mx.nd.array(X[i:i + batch]), mx.nd.array(y[i:i + batch])
        out = net(xb)
        total_loss += float(loss_fn(out, yb).sum().asscalar())
        correct += int((out.argmax(axis=1) == yb).sum().asscalar())
    n = max(len(y), 1)
    return {"loss": total_loss / n, "accuracy": correct / n}


def run(job: JobSpec) -> dict[str, Any]:
    mx = import_mxnet()
    cfg = job.config
    kv = mx.kv.create(cfg.cluster.kvstore)
    rank, num_workers = kv.rank, kv.num_workers
    ctx = mx.cpu()
    log.info("worker %d/%d started (kvstore=%s) optimizer on the %s", rank, num_workers, cfg.cluster.kvstore,
             cfg.cluster.optimizer_placement)

    manifest = data.load_manifest(job.shards_prefix)
    steps = data.steps_per_epoch(manifest, num_workers, cfg.optim.batch_size)
    with tempfile.TemporaryDirectory(prefix="mxpipe-shards-") as work_dir:
        X, y = data.fetch_split(manifest, job.shards_prefix, data.shards_for_rank(manifest, rank, num_workers), work_dir)
        val = [s for s in manifest["shards"] if s["split"] == "val"]
        Xv, yv = data.fetch_split(manifest, job.shards_prefix, val, work_dir) if rank == 0 else (None, None)

    mx.random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    net = build_model(cfg, manifest["num_classes"])
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net(mx.nd.zeros((1, manifest["num_features"])))  # materialise deferred shapes before any load
    net.hybridize()

    store = CheckpointStore(job.checkpoint_prefix, keep=cfg.checkpoint.keep)
    ckpt = store.latest()
    epoch, start_step, global_step, history = 0, 0, 0, []
    if ckpt is not None:
        _check_compatible(ckpt.state, job, num_workers)
        _load_params_bytes(net, ckpt.files["model.params"], ctx)
        epoch, start_step = ckpt.state["epoch"], ckpt.state["step_in_epoch"]
        global_step, history = ckpt.state["global_step"], ckpt.state["history"]
        log.info("resumed from step %d (epoch %d, step %d in epoch); optimizer state restarts from zero",
                 global_step, epoch, start_step)

    global_batch = cfg.optim.batch_size * num_workers
    # Built after the parameters are final (fresh or restored) and before the first forward.
    trainer = make_trainer(net.collect_params(), cfg.optim.optimizer, _optimizer_params(cfg), kv,
                           cfg.cluster.optimizer_placement, batch_size=global_batch)
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    order = data.EpochOrder(len(y), steps, cfg.optim.batch_size, cfg.seed, rank)

    def save_checkpoint(ep: int, step_in_epoch: int) -> None:
        if rank != 0:
            return
        state = {"epoch": ep, "step_in_epoch": step_in_epoch, "global_step": global_step,
                 "history": history, "config_digest": cfg.digest(), "num_workers": num_workers,
                 "manifest_digest": data.manifest_digest(manifest)}
        store.save(global_step, {"model.params": _params_bytes(net)}, state)

    started = last_log = time.monotonic()
    samples_seen = 0
    while epoch < cfg.optim.epochs:
        epoch_loss, epoch_n = 0.0, 0
        for step, idx in order.batches(epoch, start_step):
            xb, yb = mx.nd.array(X[idx], ctx=ctx), mx.nd.array(y[idx], ctx=ctx)
            with mx.autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(global_batch)
            batch_loss = float(loss.mean().asscalar())
            if not math.isfinite(batch_loss):
                raise NaNLossError(f"loss is {batch_loss} at global step {global_step + 1} (epoch {epoch})")
            epoch_loss += batch_loss * len(idx)
            epoch_n += len(idx)
            global_step += 1
            samples_seen += len(idx)
            faults.maybe_kill(global_step, rank)
            faults.maybe_hang(global_step, rank)
            if global_step % cfg.checkpoint.every_n_steps == 0 and step + 1 < steps:
                save_checkpoint(epoch, step + 1)
            now = time.monotonic()
            if now - last_log >= PROGRESS_EVERY_S:
                rate = samples_seen / (now - started)
                remaining = (cfg.optim.epochs - epoch) * steps - (step + 1)
                eta = remaining * len(idx) / rate if rate else float("nan")
                log.info("progress epoch=%d step=%d/%d global_step=%d loss=%.4f samples/s=%.0f eta=%.0fs",
                         epoch, step + 1, steps, global_step, batch_loss, rate, eta)
                last_log = now
        record = {"epoch": epoch, "train_loss": epoch_loss / max(epoch_n, 1), "global_step": global_step}
        if rank == 0:
            record.update({f"val_{k}": v for k, v in evaluate(net, Xv, yv).items()})
        history.append(record)
        log.info("epoch %d done: %s", epoch, json.dumps(record))
        epoch, start_step = epoch + 1, 0
        save_checkpoint(epoch, 0)

    elapsed = time.monotonic() - started
    result = {"global_step": global_step, "epochs": cfg.optim.epochs, "history": history,
              "samples_per_s_worker": samples_seen / elapsed if elapsed else 0.0, "num_workers": num_workers}
    if rank == 0:
        _export(net, manifest, job.model_prefix)
        storage.put_bytes(job.metrics_uri, json.dumps(result, indent=2).encode())
        log.info("model exported to %s", job.model_prefix)
    return result


def _check_compatible(state: dict[str, Any], job: JobSpec, num_workers: int) -> None:
    if state["config_digest"] != job.config.digest():
        raise ValueError(f"checkpoint was written with config {state['config_digest']}, "
                         f"this job's config is {job.config.digest()}: refusing to mix them")
    if state["num_workers"] != num_workers:
        log.warning("checkpoint was written by %d workers, resuming with %d: the data order changes",
                    state["num_workers"], num_workers)


def _export(net: Any, manifest: dict[str, Any], model_prefix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        net.export(os.path.join(tmp, "model"), epoch=0)
        meta = {"feature_columns": manifest["feature_columns"], "classes": manifest["classes"],
                "input_shape": manifest.get("input_shape", []), "num_features": manifest["num_features"]}
        with open(os.path.join(tmp, "model_meta.json"), "w") as fh:
            json.dump(meta, fh, indent=2)
        for fname in sorted(os.listdir(tmp)):
            storage.upload_file(os.path.join(tmp, fname), storage.join(model_prefix, fname))
