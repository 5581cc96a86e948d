"""One worker of a training job: load → loop {step, maybe checkpoint, maybe evaluate} → export.

Run as a role process by the launcher (``python -m training worker JOB_URI``) with the ps-lite
``DMLC_*`` variables set. Rank 0 is the only writer of checkpoints, metrics and the model.

Optimizer placement (``cluster.optimizer_on``): on the workers by default (gradients summed
through the servers, every worker applies the same step; the state a later change needs for
``Trainer.save_states``), or on the servers (required by ``dist_async``). The trainer comes
from ``training.loop.kvstore_sync.make_trainer``, which syncs the kvstore before the first forward:
gluon's lazy sync inside the first ``step()`` is what made the worker-side optimizer give
wrong models under ``dist_sync`` (docs/architecture.md, "Correctness trap"; docs/kvstore-correctness.md).
Resume is exact with the optimizer on the workers: rank 0's checkpoints hold parameters,
optimizer state (``Trainer.save_states`` bytes, one file per stage for a split model; every
worker holds the same in ``dist_sync``),
data position, metric history, and every step re-seeds the RNGs from (seed, step, rank;
MXNet's only if the network draws from it), so a resumed job computes the same parameters as an uninterrupted one
(``training.checkpoint.state``). With the optimizer on the servers the optimizer state
restarts from zero (logged). Checkpoints are written in the background
(``training.checkpoint.writer``); SIGTERM makes rank 0 write an emergency checkpoint and every
worker exit with ``EXIT_PREEMPTED`` (retryable).

What one optimizer step does (contexts, gradient accumulation, AMP) is ``training.loop.step``; the
optimizer and its learning-rate schedule, positioned at the resumed global step, are
``training.loop.optim``. ``global_step`` counts optimizer steps (one push each). The train rows are
memory-mapped shards (``training.feed.shard_reader``); each step's batch is built ahead of it in a
thread (``training.feed.prefetch``, ``data.prefetch_batches`` deep).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from typing import Any

import numpy as np

from common import fpmode, storage
from common.mx import import_mxnet
from training.checkpoint import state as ckpt_state
from training.feed import data
from training.loop import faults
from training.checkpoint.store import store_for
from training.checkpoint.writer import Checkpointer
from training.launch.job import EXIT_PREEMPTED, JobSpec
from training.loop.kvstore_sync import make_trainer, with_gradient_compression
from training.loop.metrics import StepRecorder, ThroughputMeter
from training.loop.model import build_model, draws_random
from training.loop.optim import learning_rate_at, optimizer_params, reposition
from training.loop.placement import SplitNet, make_split_trainer
from training.feed.prefetch import prefetched
from training.loop.step import LossCheck, NaNLossError, StepRunner, contexts, init_amp, prepare

__all__ = ["NaNLossError", "run", "evaluate", "resume_digest"]

log = logging.getLogger(__name__)


def evaluate(net: Any, X: np.ndarray, y: np.ndarray, batch: int = 512, ctx: Any = None) -> dict[str, float]:
    mx = import_mxnet()
    ctx = ctx or mx.cpu()
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    total_loss, correct = 0.0, 0
    for i in range(0, len(y), batch):
        xb, yb = mx.nd.array(X[i:i + batch], ctx=ctx), mx.nd.array(y[i:i + batch], ctx=ctx)
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
    ctxs = contexts(cfg)
    ctx = ctxs[0]
    log.info("worker %d/%d started (kvstore=%s) optimizer on the %s; contexts %s; denormals %s", rank,
             num_workers, cfg.cluster.kvstore, cfg.cluster.optimizer_placement, ctxs,
             "flushed to zero" if fpmode.flushing() else "kept (IEEE)")
    preemption = Preemption.install()

    manifest = data.load_manifest(job.shards_prefix)
    # One step consumes accumulate_steps micro-batches of batch_size rows on every worker.
    step_rows = cfg.optim.batch_size * cfg.optim.accumulate_steps
    steps = data.steps_per_epoch(manifest, num_workers, step_rows)
    with tempfile.TemporaryDirectory(prefix="mxpipe-shards-") as work_dir:
        # Mapped, not loaded; readable after work_dir is removed (training.feed.shard_reader).
        rows = data.open_split(manifest, job.shards_prefix, data.shards_for_rank(manifest, rank, num_workers), work_dir)
        val = [s for s in manifest["shards"] if s["split"] == "val"]
        Xv, yv = data.fetch_split(manifest, job.shards_prefix, val, work_dir) if rank == 0 else (None, None)

    mx.random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    use_amp = init_amp(cfg)
    split = cfg.model.placement == "split"
    net = build_model(cfg, manifest["num_classes"])
    reseed_mxnet = draws_random(net)  # see checkpoint_state.reseed: 1.9 ms a step when true
    if split:  # model parallel: stage i's parameters on ctxs[i] only; the batch enters on ctxs[0]
        net = SplitNet(net, ctxs)
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    net(mx.nd.zeros((1, manifest["num_features"]), ctx=ctx))  # materialise deferred shapes before any load
    net.hybridize()
    if split:
        log.info("model split over %d contexts: %s", len(ctxs), net.describe())

    store = store_for(job.checkpoint_prefix, cfg.checkpoint)
    ckpt = store.latest()
    epoch, start_step, global_step, history = 0, 0, 0, []
    if ckpt is not None:
        _check_compatible(ckpt.state, job, num_workers, manifest)
        ckpt_state.load_params(net, ckpt.files[ckpt_state.PARAMS], ctx)
        epoch, start_step = ckpt.state["epoch"], ckpt.state["step_in_epoch"]
        global_step, history = ckpt.state["global_step"], ckpt.state["history"]
        if ckpt.state["num_workers"] != num_workers:
            start_step = _elastic_position(ckpt.state, num_workers, steps)
    elif job.warm_start_prefix:
        _warm_start(net, job.warm_start_prefix, cfg, ctx)
    # Older checkpoints hold no step records: the per-step curve then starts at the resume.
    step_log = StepRecorder(cfg.checkpoint.step_metrics_every_n, cfg.checkpoint.max_step_metrics,
                            ckpt.state.get("step_history") if ckpt is not None else None, global_step)

    global_batch = cfg.global_batch(num_workers)
    if cfg.cluster.gradient_compression == "2bit":
        kv = with_gradient_compression(kv, cfg.cluster.compression_threshold)
    # Built after the parameters are final (fresh or restored) and before the first forward.
    if split:
        trainer = make_split_trainer(net, cfg.optim.optimizer,
                                     lambda: optimizer_params(cfg, num_workers, steps, global_step), kv,
                                     batch_size=global_batch)
    else:
        trainer = make_trainer(net.collect_params(), cfg.optim.optimizer,
                               optimizer_params(cfg, num_workers, steps, global_step), kv,
                               cfg.cluster.optimizer_placement, batch_size=global_batch)
    if ckpt is not None:
        restored = ckpt_state.restore_optimizer(trainer, net, ckpt.files, ckpt.state, ckpt.uri)
        if restored:
            reposition(trainer, cfg, num_workers, steps, global_step)
        log.info("resumed from step %d (epoch %d, step %d in epoch); optimizer state %s", global_step, epoch,
                 start_step, "restored" if restored else "restarts from zero")
    elif not ckpt_state.saves_optimizer_state(trainer) and rank == 0:
        log.warning("optimizer on the servers: checkpoints hold no optimizer state, a resume restarts it from zero")
    prepare(net, trainer, cfg.optim.accumulate_steps, use_amp)
    train_step = StepRunner(net, trainer, mx.gluon.loss.SoftmaxCrossEntropyLoss(), ctxs[:1] if split else ctxs,
                            batch_size=cfg.optim.batch_size, accumulate_steps=cfg.optim.accumulate_steps,
                            global_batch=global_batch, use_amp=use_amp)
    order = data.EpochOrder(rows.num_rows, steps, step_rows, cfg.seed, rank)

    writer = None
    if rank == 0:
        store.before_commit = faults.kill_in_upload_hook()
        writer = Checkpointer(store, asynchronous=cfg.checkpoint.async_upload,
                              upload_timeout_s=cfg.checkpoint.upload_timeout_s)
    last_ckpt_t = time.monotonic()

    def checkpoint(ep: int, step_in_epoch: int, *, must: bool, deadline: float | None = None) -> None:
        nonlocal last_ckpt_t
        if writer is None:
            return
        started = time.monotonic()
        if not must and writer.busy:
            writer.stats.skipped += 1
            log.info("checkpoint at step %d skipped: the previous one is still uploading", global_step)
            return
        state = {"epoch": ep, "step_in_epoch": step_in_epoch, "global_step": global_step,
                 "history": history, "step_history": step_log.records, "config_digest": cfg.digest(), "resume_digest": resume_digest(cfg),
                 "num_workers": num_workers, "global_batch": global_batch,
                 "manifest_digest": data.manifest_digest(manifest), "rng": RNG_SCHEME}
        snap = ckpt_state.snapshot(net, trainer, global_step, state)
        writer.stats.blocked_s += time.monotonic() - started
        writer.submit(snap, must=must, deadline=deadline)
        last_ckpt_t = time.monotonic()

    step_lr: dict[int, float] = {}

    def record_step(step: int, loss: float) -> None:
        if step in step_lr:
            step_log.record(step, loss, step_lr.pop(step))

    started = time.monotonic()
    meter = ThroughputMeter(num_workers, started)
    resumed_from = global_step if ckpt is not None else None
    if ckpt is not None and epoch >= cfg.optim.epochs:
        # The previous attempt died after its final checkpoint (while exporting, or the task
        # was killed after the job): nothing is left to train, only the export is redone.
        log.info("resumed at the final step %d: nothing left to train, exporting again", global_step)
        net(mx.nd.zeros((1, manifest["num_features"]), ctx=ctx))  # export needs one hybridized forward
    while epoch < cfg.optim.epochs:
        # Losses are read back at most LOSS_CHECK_EVERY steps at a time (each read drains the
        # engine: training.loop.step), and before anything that needs them or must not see a
        # diverged model (checkpoint, progress line, epoch end).
        losses = LossCheck(on_loss=record_step)
        meter.start_epoch()
        # The epoch's batches, built data.prefetch_batches ahead in a thread (training.feed.prefetch).
        feed = prefetched(order.batches(epoch, start_step), lambda ix: train_step.load(rows.gather, ix),
                          cfg.data.prefetch_batches, label=f"epoch {epoch}")
        for step, idx, batch in feed:
            ckpt_state.reseed(cfg.seed, global_step, rank, mxnet=reseed_mxnet)  # same draws, resumed or not
            _checked(epoch, losses.add, global_step + 1, train_step.run_batch(batch), len(idx))
            global_step += 1
            meter.count(len(idx))
            if step_log.due(global_step):  # the rate now; the loss once LossCheck reads it
                step_lr[global_step] = learning_rate_at(trainer)
            if resumed_from is not None and global_step == resumed_from + 1:
                _checked(epoch, losses.flush)  # done means computed, not queued
                # The mark recovery time is measured to (benchmarks/chaos.py, recovery.py).
                log.info("first step after resume done: global_step=%d (resumed from step %d)", global_step,
                         resumed_from)
            faults.maybe_kill(global_step, rank)
            faults.maybe_hang(global_step, rank)
            faults.maybe_terminate(global_step, rank)
            if preemption.requested and step + 1 < steps:  # at an epoch end: after its checkpoint
                _checked(epoch, losses.flush)
                _preempted(preemption, cfg, rank, global_step, writer,
                           lambda d, ep=epoch, st=step: checkpoint(ep, st + 1, must=True, deadline=d))
            now = time.monotonic()
            due = (global_step % cfg.checkpoint.every_n_steps == 0
                   or (cfg.checkpoint.every_n_seconds > 0 and now - last_ckpt_t >= cfg.checkpoint.every_n_seconds))
            if due and step + 1 < steps:
                _checked(epoch, losses.flush)
                checkpoint(epoch, step + 1, must=False)
            if meter.due(now):
                _checked(epoch, losses.flush)
                remaining = (cfg.optim.epochs - epoch) * steps - (step + 1)
                log.info("progress %s", meter.line(epoch, step + 1, steps, global_step, losses.last, remaining,
                                                   len(idx), now))
        _checked(epoch, losses.flush)
        # The last step's update inside the epoch's time too (the bare loop's waitall).
        mx.nd.waitall()
        # The loop's own rate (steps and periodic checkpoints; not the evaluation or epoch-end
        # checkpoint below): what throughput benchmarks compare in steady state.
        record = {"epoch": epoch, "train_loss": losses.loss_sum / max(losses.rows, 1), "global_step": global_step,
                  "learning_rate": learning_rate_at(trainer), **meter.epoch_metrics()}
        if rank == 0:
            record.update({f"val_{k}": v for k, v in evaluate(net, Xv, yv, ctx=ctx).items()})
        history.append(record)
        remaining = (cfg.optim.epochs - epoch - 1) * steps
        log.info("epoch %d done: step=%d loss=%.4f samples/s=%.0f (all workers %.0f) eta=%.0fs %s", epoch,
                 global_step, record["train_loss"], record["samples_per_s_worker"], record["samples_per_s_total"],
                 remaining * record["step_time_s"], json.dumps(record))
        epoch, start_step = epoch + 1, 0
        checkpoint(epoch, 0, must=True)
        if preemption.requested:
            _preempted(preemption, cfg, rank, global_step, writer, None)

    result = {"global_step": global_step, "epochs": cfg.optim.epochs, "history": history,
              "step_history": step_log.records,
              "num_workers": num_workers, **meter.totals(time.monotonic()),
              # This attempt's counts: one trainer.step (one push per parameter) per k micro-batches;
              # the worker-side optimizer's update count (None when it runs on the servers).
              "micro_batches": train_step.micro_batches, "optimizer_steps": train_step.optimizer_steps,
              "optimizer_updates": (int(trainer._optimizer.num_update)
                                    if cfg.cluster.optimizer_placement == "workers" else None)}
    if writer is not None:
        waited = time.monotonic()
        writer.close()
        writer.stats.blocked_s += time.monotonic() - waited
        result["checkpoint"] = writer.stats.as_dict()
        final_restored = ckpt is not None and ckpt.step == global_step
        if writer.stats.steps[-1:] != [global_step] and not final_restored:
            raise RuntimeError(f"the final checkpoint (step {global_step}) was not committed; see the log above")
    if rank == 0:
        _export(net, manifest, job.model_prefix)
        storage.put_bytes(job.metrics_uri, json.dumps(result, indent=2).encode())
        log.info("model exported to %s", job.model_prefix)
    return result


def _checked(epoch: int, read: Any, *args: Any) -> None:
    """``read(*args)`` (a LossCheck add or flush); a NaN/inf loss names its step and epoch."""
    try:
        read(*args)
    except NaNLossError as exc:
        raise NaNLossError(f"{exc} at global step {exc.step} (epoch {epoch})", exc.step) from None


RNG_SCHEME = "per-step reseed of python/numpy/mxnet (mxnet only if the net draws) from sha256(seed:global_step:rank)"


class Preemption:
    """SIGTERM sets a flag; the loop acts on it between steps, where the state is consistent."""

    def __init__(self) -> None:
        self.requested_at: float | None = None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    @classmethod
    def install(cls) -> "Preemption":
        flag = cls()

        def on_term(signum: int, frame: Any) -> None:
            if flag.requested_at is None:
                flag.requested_at = time.monotonic()

        signal.signal(signal.SIGTERM, on_term)
        return flag


def _preempted(preemption: Preemption, cfg: Any, rank: int, global_step: int, writer: Checkpointer | None,
               save: Any) -> None:
    """Rank 0 writes an emergency checkpoint within the grace period; every rank exits 75.

    A non-zero rank can only exit: ps-lite cannot lose a worker, so rank 0 and the others block
    in their next step until the supervisor sees the exit code and stops the job; the retry
    resumes from the newest committed checkpoint (at most one cadence interval old).
    """
    assert preemption.requested_at is not None
    deadline = preemption.requested_at + cfg.checkpoint.preempt_grace_s
    if writer is not None:
        log.warning("SIGTERM: writing an emergency checkpoint at step %d (grace %.0fs)", global_step,
                    cfg.checkpoint.preempt_grace_s)
        if save is not None:
            save(deadline)
        writer.close(deadline)
        ok = global_step in writer.stats.steps
        log.warning("emergency checkpoint at step %d %s", global_step,
                    "committed" if ok else "NOT committed within the grace period")
    else:
        log.warning("SIGTERM on worker %d at step %d: exiting (only rank 0 writes checkpoints)", rank, global_step)
    # os._exit, not SystemExit: the kvstore's destructor would wait in a ps-lite barrier for
    # workers that never reach it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_PREEMPTED)


def _warm_start(net: Any, prefix: str, cfg: Any, ctx: Any) -> None:
    """Initialise the parameters (only: epoch, step and optimizer state start fresh) from the
    newest valid checkpoint under another run's prefix. Every worker loads the same bytes."""
    ckpt = store_for(prefix, cfg.checkpoint).latest()
    if ckpt is None:
        raise ValueError(f"warm start: no valid checkpoint under {prefix}")
    ckpt_state.load_params(net, ckpt.files[ckpt_state.PARAMS], ctx)
    log.info("warm start: parameters from step %d of %s", ckpt.step, ckpt.uri)


def resume_digest(cfg: Any) -> str:
    """The part of the config a checkpoint must match: what is trained and how, not the cadence,
    retention, encryption, timeouts or (elastic) the cluster size."""
    raw = cfg.to_dict()
    raw.pop("checkpoint")
    raw["data"].pop("prefetch_batches")  # how far ahead batches are built does not change them
    if raw["model"]["placement"] == "replicated":  # left out when default: older checkpoints still match
        raw["model"].pop("placement")
    cluster = raw.pop("cluster")
    raw["cluster"] = {"kvstore": cluster["kvstore"], "optimizer_on": cfg.cluster.optimizer_placement}
    if cluster["gradient_compression"] != "none":  # left out when off: older checkpoints still match
        raw["cluster"].update(gradient_compression=cluster["gradient_compression"],
                              compression_threshold=cluster["compression_threshold"])
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def _elastic_position(state: dict[str, Any], num_workers: int, steps: int) -> int:
    """Where to continue the epoch with another worker count: after as many samples as the old
    job consumed (rounded down, so none is skipped; the new assignment means the rest of this
    epoch is drawn from the new per-rank orders)."""
    consumed = state["step_in_epoch"] * state["global_batch"]
    new_global = state["global_batch"] // state["num_workers"] * num_workers
    start = min(consumed // new_global, steps - 1)
    log.warning("elastic resume: %d workers → %d; epoch %d continues at step %d of %d (global batch %d → %d, "
                "learning rate unchanged)", state["num_workers"], num_workers, state["epoch"], start, steps,
                state["global_batch"], new_global)
    return start


def _check_compatible(state: dict[str, Any], job: JobSpec, num_workers: int, manifest: dict[str, Any]) -> None:
    cfg = job.config
    if "resume_digest" in state:
        ok = state["resume_digest"] == resume_digest(cfg)
    else:  # written before resume digests existed
        ok = state["config_digest"] == cfg.digest()
    if not ok:
        raise ValueError(f"checkpoint was written with config {state['config_digest']}, "
                         f"this job's config is {cfg.digest()}: refusing to mix them")
    if state["num_workers"] != num_workers:
        if not cfg.checkpoint.elastic:
            raise ValueError(f"checkpoint was written by {state['num_workers']} workers, this job has "
                             f"{num_workers}: set checkpoint.elastic=true to resume with another worker count")
        if "global_batch" not in state:
            raise ValueError("checkpoint predates elastic resume (no global_batch recorded)")
    if state.get("manifest_digest") not in (None, data.manifest_digest(manifest)):
        log.warning("checkpoint was written over other shards (manifest %s, now %s)", state["manifest_digest"],
                    data.manifest_digest(manifest))


def _export(net: Any, manifest: dict[str, Any], model_prefix: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        net.export(os.path.join(tmp, "model"), epoch=0)
        meta = {"feature_columns": manifest["feature_columns"], "classes": manifest["classes"],
                "input_shape": manifest.get("input_shape", []), "num_features": manifest["num_features"]}
        with open(os.path.join(tmp, "model_meta.json"), "w") as fh:
            json.dump(meta, fh, indent=2)
        for fname in sorted(os.listdir(tmp)):
            storage.upload_file(os.path.join(tmp, fname), storage.join(model_prefix, fname))
