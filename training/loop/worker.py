"""One worker of a training job: set up → resume → {step, maybe checkpoint, maybe evaluate} → export.

Run as a role process by the launcher (``python -m training worker JOB_URI``) with the ps-lite
``DMLC_*`` variables set. Rank 0 is the only writer of checkpoints, metrics and the model.
``run`` reads top to bottom: ``build_cluster`` (kvstore, contexts), ``build_data`` (shards),
``build_net`` (the model, seeded), ``resume.restore`` (parameters and position), ``build_loop``
(trainer, step runner, data order), the checkpoint manager, ``train`` (each epoch's steps, then
its end: evaluation, log line, epoch-end checkpoint), the final commit check and ``export``.

Optimizer placement (``cluster.optimizer_on``): on the workers by default (gradients summed
through the servers, every worker applies the same step; the state a later change needs for
``Trainer.save_states``), or on the servers (required by ``dist_async``). The trainer comes
from ``training.loop.kvstore_sync.make_trainer``, which syncs the kvstore before the first forward:
gluon's lazy sync inside the first ``step()`` is what made the worker-side optimizer give
wrong models under ``dist_sync`` (docs/architecture.md, "Correctness trap"; docs/kvstore-correctness.md).
Resume is exact with the optimizer on the workers: rank 0's checkpoints hold parameters,
optimizer state (``Trainer.save_states`` bytes, one file per stage for a split model; every
worker holds the same in ``dist_sync``),
data position, metric history (``training.loop.resume``), and every step re-seeds the RNGs from
(seed, step, rank; MXNet's only if the network draws from it), so a resumed job computes the same
parameters as an uninterrupted one (``training.checkpoint.state``). With the optimizer on the
servers the optimizer state restarts from zero (logged). When rank 0 checkpoints, what a save
may skip, the save statistics and the emergency checkpoint on SIGTERM are
``training.checkpoint.manager`` (the upload runs in the background, ``training.checkpoint.writer``);
on SIGTERM every worker exits with ``EXIT_PREEMPTED`` (retryable). Test faults
(``training.loop.faults``) are read from the environment once, before the loop.

What one optimizer step does (contexts, gradient accumulation, AMP) is ``training.loop.step``; the
optimizer and its learning-rate schedule, positioned at the resumed global step, are
``training.loop.optim``. ``global_step`` counts optimizer steps (one push each). The train rows are
memory-mapped shards (``training.feed.shard_reader``); each step's batch is built ahead of it in a
thread (``training.feed.prefetch``, ``data.prefetch_batches`` deep).

Early stopping and the best epoch (``training.loop.early_stop``): rank 0 tracks the best
validation epoch at every epoch end, every worker takes its stop decision through the kvstore,
and with ``checkpoint.export_epoch`` resolving to "best" the export holds that epoch's
parameters (read back from its epoch-end checkpoint, which retention keeps).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from common import fpmode, model_code, storage
from common.config import ModelConfig, TrainConfig
from common.manifest import is_regression, num_outputs
from common.model_code import StagedCode
from common.mx import import_mxnet
from common.procs.watchdog import preempt_on_supervisor_loss
from training.checkpoint import state as ckpt_state
from training.checkpoint.manager import CheckpointManager
from training.checkpoint.state import Snapshot
from training.checkpoint.store import Checkpoint, CheckpointStore, store_for
from training.feed import data as feed_data
from training.feed.prefetch import prefetched
from training.launch.job import EXIT_PREEMPTED, JobSpec
from training.loop import resume
from training.loop.early_stop import agree_to_stop
from training.loop.faults import FaultPlan
from training.loop.kvstore_sync import make_trainer, with_gradient_compression
from training.loop.metrics import StepRecorder, ThroughputMeter, regression_metrics
from training.loop.model import build_model, draws_random
from training.loop.optim import learning_rate_at, optimizer_params
from training.loop.placement import SplitNet, make_split_trainer
from training.loop.resume import TrainState, resume_digest
from training.loop.step import LossCheck, NaNLossError, StepRunner, contexts, init_amp, make_loss, prepare

__all__ = ["NaNLossError", "run", "evaluate", "resume_digest"]

log = logging.getLogger(__name__)

def run(job: JobSpec) -> dict[str, Any]:
    faults = FaultPlan.from_settings()  # read once: the loop only compares step numbers with it
    cfg = job.config
    if job.model_code_uri:  # before anything builds the network: a bad archive fails the role at once
        model_code.activate(StagedCode(job.model_code_uri, job.model_code_sha256))
    cluster = build_cluster(cfg)
    preemption = Preemption.install()
    if cluster.rank == 0:  # its supervisor's loss is a preemption: the emergency checkpoint first
        preempt_on_supervisor_loss(cfg.checkpoint.preempt_grace_s)
    data = build_data(job, cluster)
    model = build_net(cfg, data.manifest, cluster.ctxs)
    store = store_for(job.checkpoint_prefix, cfg.checkpoint)
    state, ckpt = resume.restore(store, job, model.net, cluster.ctxs[0], cluster.num_workers, data.steps,
                                 data.manifest)
    resumed_from = state.global_step if ckpt is not None else None
    loop = build_loop(cfg, cluster, data, model, state, ckpt)
    loop.code_sha256 = job.model_code_sha256
    store.before_commit = faults.before_commit_hook()  # a test's torn checkpoint (only rank 0 saves)
    ckpts = CheckpointManager(store, cfg.checkpoint, data.steps, loop.snapshot, rank=cluster.rank,
                              resumed_step=resumed_from)
    meter = ThroughputMeter(cluster.num_workers, time.monotonic())
    train(loop, ckpts, faults, preemption, meter, resumed_from)
    result = loop.result(meter)
    stats = ckpts.finish(state.global_step)  # raises if the final checkpoint was not committed
    if stats is not None:
        result["checkpoint"] = stats
    if cluster.rank == 0:
        if cfg.exports_best:
            load_best(model.net, store, state, cluster.ctxs[0])
        export(model.net, data.manifest, job.model_prefix)
        storage.put_bytes(job.metrics_uri, json.dumps(result, indent=2).encode())
        log.info("model exported to %s", job.model_prefix)
    return result


# -- set up ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """This worker's place in the job."""

    kv: Any
    rank: int
    num_workers: int
    ctxs: list[Any]  # the devices of this worker (``cluster.devices_per_worker``); the batch enters on the first


@dataclass(frozen=True)
class Data:
    """The job's shards as this worker reads them."""

    manifest: dict[str, Any]
    steps: int  # optimizer steps per epoch, the same on every worker
    rows: Any  # this rank's train rows, memory-mapped (training.feed.shard_reader)
    val: tuple[np.ndarray, np.ndarray] | None  # rank 0's validation split (features, labels or targets)


@dataclass(frozen=True)
class Model:
    net: Any  # a gluon block, or a SplitNet over the contexts
    split: bool
    use_amp: bool
    reseed_mxnet: bool  # whether the net draws MXNet random numbers (see ckpt_state.reseed: 1.9 ms a step)


def build_cluster(cfg: TrainConfig) -> Cluster:
    mx = import_mxnet()
    kv = mx.kv.create(cfg.cluster.kvstore)
    ctxs = contexts(cfg)
    log.info("worker %d/%d started (kvstore=%s) optimizer on the %s; contexts %s; denormals %s", kv.rank,
             kv.num_workers, cfg.cluster.kvstore, cfg.cluster.optimizer_placement, ctxs,
             "flushed to zero" if fpmode.flushing() else "kept (IEEE)")
    return Cluster(kv=kv, rank=kv.rank, num_workers=kv.num_workers, ctxs=ctxs)


def build_data(job: JobSpec, cluster: Cluster) -> Data:
    cfg = job.config
    manifest = feed_data.load_manifest(job.shards_prefix)
    steps = feed_data.steps_per_epoch(manifest, cluster.num_workers, _step_rows(cfg))
    with tempfile.TemporaryDirectory(prefix="mxpipe-shards-") as work_dir:
        # Mapped, not loaded; readable after work_dir is removed (training.feed.shard_reader).
        rows = feed_data.open_split(manifest, job.shards_prefix,
                                    feed_data.shards_for_rank(manifest, cluster.rank, cluster.num_workers), work_dir)
        val = None
        if cluster.rank == 0:
            val_shards = [s for s in manifest["shards"] if s["split"] == "val"]
            val = feed_data.fetch_split(manifest, job.shards_prefix, val_shards, work_dir)
    return Data(manifest=manifest, steps=steps, rows=rows, val=val)


def _step_rows(cfg: TrainConfig) -> int:
    """One step consumes accumulate_steps micro-batches of batch_size rows on every worker."""
    return cfg.optim.batch_size * cfg.optim.accumulate_steps


def build_net(cfg: TrainConfig, manifest: dict[str, Any], ctxs: list[Any]) -> Model:
    """The model, seeded and initialised on ``ctxs``, its deferred shapes materialised, hybridized."""
    mx = import_mxnet()
    mx.random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    use_amp = init_amp(cfg)
    split = cfg.model.placement == "split"
    net = build_model(cfg, num_outputs(manifest), manifest["num_features"])
    reseed_mxnet = draws_random(net)
    if split:  # model parallel: stage i's parameters on ctxs[i] only; the batch enters on ctxs[0]
        net = SplitNet(net, ctxs)
    net.initialize(mx.init.Xavier(), ctx=ctxs)
    net(mx.nd.zeros((1, manifest["num_features"]), ctx=ctxs[0]))  # materialise deferred shapes before any load
    net.hybridize()
    if split:
        log.info("model split over %d contexts: %s", len(ctxs), net.describe())
    return Model(net=net, split=split, use_amp=use_amp, reseed_mxnet=reseed_mxnet)


@dataclass
class Loop:
    """Everything the steps run on, built once the parameters are final (fresh or restored)."""

    cfg: TrainConfig
    cluster: Cluster
    data: Data
    model: Model
    state: TrainState
    trainer: Any
    train_step: StepRunner
    order: feed_data.EpochOrder
    step_log: StepRecorder
    code_sha256: str = ""  # a custom network's staged code (JobSpec.model_code_sha256)

    def snapshot(self, global_step: int) -> Snapshot:
        """What a checkpoint of the current state holds (the manager calls it when it saves)."""
        record = resume.train_record(self.state, self.step_log.records, self.cfg, self.cluster.num_workers,
                                     self.data.manifest, self.code_sha256)
        return ckpt_state.snapshot(self.model.net, self.trainer, global_step, record)

    def result(self, meter: ThroughputMeter) -> dict[str, Any]:
        """The job's metrics (rank 0 writes them next to the model)."""
        return {"global_step": self.state.global_step, "epochs": self.cfg.optim.epochs, "history": self.state.history,
                "step_history": self.step_log.records, "num_workers": self.cluster.num_workers,
                **meter.totals(time.monotonic()),
                # This attempt's counts: one trainer.step (one push per parameter) per k micro-batches;
                # the worker-side optimizer's update count (None when it runs on the servers).
                "micro_batches": self.train_step.micro_batches, "optimizer_steps": self.train_step.optimizer_steps,
                "optimizer_updates": (int(self.trainer._optimizer.num_update)
                                      if self.cfg.cluster.optimizer_placement == "workers" else None),
                # Which epoch was selected and why (training.loop.early_stop); absent when not tracked.
                **({"best": self.state.best.summary("best" if self.cfg.exports_best else "last")}
                   if self.state.best is not None else {})}


def build_loop(cfg: TrainConfig, cluster: Cluster, data: Data, model: Model, state: TrainState,
               ckpt: Checkpoint | None) -> Loop:
    """The trainer (with the checkpoint's optimizer state), the step runner and the data order."""
    mx = import_mxnet()
    num_workers, steps, net = cluster.num_workers, data.steps, model.net
    # Older checkpoints hold no step records: the per-step curve then starts at the resume.
    step_log = StepRecorder(cfg.checkpoint.step_metrics_every_n, cfg.checkpoint.max_step_metrics,
                            ckpt.state.get("step_history") if ckpt is not None else None, state.global_step)
    global_batch = cfg.global_batch(num_workers)
    kv = cluster.kv
    if cfg.cluster.gradient_compression == "2bit":
        kv = with_gradient_compression(kv, cfg.cluster.compression_threshold)
    # Built after the parameters are final (fresh or restored) and before the first forward.
    if model.split:
        trainer = make_split_trainer(net, cfg.optim.optimizer,
                                     functools.partial(optimizer_params, cfg, num_workers, steps, state.global_step),
                                     kv, batch_size=global_batch)
    else:
        trainer = make_trainer(net.collect_params(), cfg.optim.optimizer,
                               optimizer_params(cfg, num_workers, steps, state.global_step), kv,
                               cfg.cluster.optimizer_placement, batch_size=global_batch)
    resume.restore_optimizer(trainer, net, ckpt, state, cfg, num_workers, steps, cluster.rank)
    prepare(net, trainer, cfg.optim.accumulate_steps, model.use_amp)
    train_step = StepRunner(net, trainer, make_loss(cfg.model),
                            cluster.ctxs[:1] if model.split else cluster.ctxs,
                            batch_size=cfg.optim.batch_size, accumulate_steps=cfg.optim.accumulate_steps,
                            global_batch=global_batch, use_amp=model.use_amp)
    order = feed_data.EpochOrder(data.rows.num_rows, steps, _step_rows(cfg), cfg.seed, cluster.rank)
    return Loop(cfg=cfg, cluster=cluster, data=data, model=model, state=state, trainer=trainer,
                train_step=train_step, order=order, step_log=step_log)


# -- the loop -------------------------------------------------------------------------------------


def train(loop: Loop, ckpts: CheckpointManager, faults: FaultPlan, preemption: Preemption, meter: ThroughputMeter,
          resumed_from: int | None) -> None:
    """Every epoch left: its steps, then its end (evaluation, log line, epoch-end checkpoint)."""
    state, epochs = loop.state, loop.cfg.optim.epochs
    if resumed_from is not None and (state.epoch >= epochs or state.stopped_early):
        # The previous attempt died after its final checkpoint (while exporting, or the task
        # was killed after the job): nothing is left to train, only the export is redone.
        log.info("resumed at the final step %d: nothing left to train, exporting again", state.global_step)
        mx = import_mxnet()  # the export needs one hybridized forward
        loop.model.net(mx.nd.zeros((1, loop.data.manifest["num_features"]), ctx=loop.cluster.ctxs[0]))
    while state.epoch < epochs and not state.stopped_early:
        losses = train_epoch(loop, ckpts, faults, preemption, meter, resumed_from)
        end_epoch(loop, losses, meter)
        ckpts.save(state.global_step, must=True)  # with the stop decision, so a resume there stops too
        if preemption.requested:
            preemption.exit(ckpts, state.global_step, save=False)  # the epoch-end checkpoint is the emergency one


def train_epoch(loop: Loop, ckpts: CheckpointManager, faults: FaultPlan, preemption: Preemption, meter: ThroughputMeter,
                resumed_from: int | None) -> LossCheck:
    """The rest of the current epoch's steps; returns its losses (read up to its last step but
    one at most ``LOSS_CHECK_EVERY`` steps late)."""
    cfg, state, rank, steps = loop.cfg, loop.state, loop.cluster.rank, loop.data.steps
    train_step, step_log, trainer = loop.train_step, loop.step_log, loop.trainer
    seed, reseed_mxnet, epoch = cfg.seed, loop.model.reseed_mxnet, state.epoch
    first_after_resume = resumed_from + 1 if resumed_from is not None else None
    # Losses are read back at most LOSS_CHECK_EVERY steps at a time (each read drains the
    # engine: training.loop.step), and before anything that needs them or must not see a
    # diverged model (checkpoint, progress line, epoch end).
    losses = LossCheck(on_loss=step_log.on_loss)
    meter.start_epoch()
    # The epoch's batches, built data.prefetch_batches ahead in a thread (training.feed.prefetch).
    feed = prefetched(loop.order.batches(epoch, state.step_in_epoch),
                      functools.partial(train_step.load, loop.data.rows.gather),
                      cfg.data.prefetch_batches, label=f"epoch {epoch}")
    for step, idx, batch in feed:
        ckpt_state.reseed(seed, state.global_step, rank, mxnet=reseed_mxnet)  # same draws, resumed or not
        _checked(epoch, losses.add, state.global_step + 1, train_step.run_batch(batch), len(idx))
        state.global_step = global_step = state.global_step + 1
        state.step_in_epoch = step + 1
        meter.count(len(idx))
        if step_log.due(global_step):  # the rate now; the loss once LossCheck reads it
            step_log.note_rate(global_step, learning_rate_at(trainer))
        if global_step == first_after_resume:
            _checked(epoch, losses.flush)  # done means computed, not queued
            # The mark recovery time is measured to (benchmarks/chaos.py, recovery.py).
            log.info("first step after resume done: global_step=%d (resumed from step %d)", global_step,
                     resumed_from)
        faults.at_step(global_step, rank)
        if preemption.requested and step + 1 < steps:  # at the epoch's last step: after its checkpoint
            _checked(epoch, losses.flush)
            preemption.exit(ckpts, global_step, save=True)
        now = time.monotonic()
        if ckpts.due(global_step, step + 1, now):
            _checked(epoch, losses.flush)
            ckpts.save(global_step, must=False)
        if meter.due(now):
            _checked(epoch, losses.flush)
            remaining = (cfg.optim.epochs - epoch) * steps - (step + 1)
            log.info("progress %s", meter.line(epoch, step + 1, steps, global_step, losses.last, remaining,
                                               len(idx), now))
    return losses


def end_epoch(loop: Loop, losses: LossCheck, meter: ThroughputMeter) -> None:
    """The epoch's record (rank 0 evaluates), its log line, and the position of the next one."""
    mx = import_mxnet()
    state, cfg, steps = loop.state, loop.cfg, loop.data.steps
    _checked(state.epoch, losses.flush)
    # The last step's update inside the epoch's time too (the bare loop's waitall).
    mx.nd.waitall()
    # The loop's own rate (steps and periodic checkpoints; not the evaluation or epoch-end
    # checkpoint below): what throughput benchmarks compare in steady state.
    record = {"epoch": state.epoch, "train_loss": losses.loss_sum / max(losses.rows, 1),
              "global_step": state.global_step, "learning_rate": learning_rate_at(loop.trainer),
              **meter.epoch_metrics()}
    if loop.data.val is not None:  # rank 0
        record.update({f"val_{k}": v for k, v in evaluate(loop.model.net, *loop.data.val, ctx=loop.cluster.ctxs[0],
                                                           model=cfg.model).items()})
    state.history.append(record)
    remaining = (cfg.optim.epochs - state.epoch - 1) * steps
    log.info("epoch %d done: step=%d loss=%.4f samples/s=%.0f (all workers %.0f) eta=%.0fs %s", state.epoch,
             state.global_step, record["train_loss"], record["samples_per_s_worker"],
             record["samples_per_s_total"], remaining * record["step_time_s"], json.dumps(record))
    if state.best is not None:
        track_best(loop, record)
    state.epoch, state.step_in_epoch = state.epoch + 1, 0


def track_best(loop: Loop, record: dict[str, Any]) -> None:
    """Rank 0 (the one that evaluated) updates the best epoch; every worker takes rank 0's stop
    decision, so all of them stop after the same step (training.loop.early_stop)."""
    best, cluster, epoch = loop.state.best, loop.cluster, loop.state.epoch
    if cluster.rank == 0 and best.update(record):
        log.info("best epoch so far: %d (%s=%.6g, step %d)", epoch, best.metric, best.value, best.step)
    if best.patience == 0 or epoch + 1 == loop.cfg.optim.epochs:  # nothing to decide: no barrier
        return
    if agree_to_stop(cluster.kv, epoch, cluster.rank == 0 and best.patience_ran_out, cluster.num_workers):
        best.stopped_at = epoch
        log.info("early stopping after epoch %d: %s has not improved by more than %g for %d epochs; best epoch %s",
                 epoch, best.metric, best.min_delta, best.patience,
                 f"{best.epoch} ({best.value:.6g})" if cluster.rank == 0 else "on rank 0")


def load_best(net: Any, store: CheckpointStore, state: TrainState, ctx: Any) -> None:
    """The best epoch's parameters into ``net`` (from its epoch-end checkpoint, which retention
    keeps), unless the current ones are those."""
    best = state.best
    if best.step is None:
        raise ValueError("no validated epoch to export: checkpoint.export_epoch='best' needs at least one "
                         "finished epoch")
    if best.step != state.global_step:
        ckpt = store.load(best.step)
        ckpt_state.load_params(net, ckpt.files[ckpt_state.PARAMS], ctx)
    log.info("exporting the best epoch's parameters: epoch %d (%s=%.6g, step %d)", best.epoch, best.metric,
             best.value, best.step)


def evaluate(net: Any, X: np.ndarray, y: np.ndarray, batch: int = 512, ctx: Any = None,
             model: ModelConfig | None = None) -> dict[str, float]:
    """The task's metrics of ``net`` on ``(X, y)`` (``training.loop.metrics.TASK_METRICS``);
    ``model`` None: classification."""
    mx = import_mxnet()
    ctx = ctx or mx.cpu()
    if model is not None and model.task == "regression":
        return _evaluate_regression(net, X, y, batch, ctx, make_loss(model))
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    total_loss, correct = 0.0, 0
    for i in range(0, len(y), batch):
        xb, yb = mx.nd.array(X[i:i + batch], ctx=ctx), mx.nd.array(y[i:i + batch], ctx=ctx)
        out = net(xb)
        total_loss += float(loss_fn(out, yb).sum().asscalar())
        correct += int((out.argmax(axis=1) == yb).sum().asscalar())
    n = max(len(y), 1)
    return {"loss": total_loss / n, "accuracy": correct / n}


def _evaluate_regression(net: Any, X: np.ndarray, y: np.ndarray, batch: int, ctx: Any, loss_fn: Any) -> dict[str, float]:
    mx = import_mxnet()
    total_loss, preds = 0.0, []
    for i in range(0, len(y), batch):
        xb, yb = mx.nd.array(X[i:i + batch], ctx=ctx), mx.nd.array(y[i:i + batch], ctx=ctx)
        out = net(xb)
        total_loss += float(loss_fn(out, yb).sum().asscalar())
        preds.append(out.asnumpy())
    return {"loss": total_loss / max(len(y), 1), **regression_metrics(np.concatenate(preds), y)}


def _checked(epoch: int, read: Any, *args: Any) -> None:
    """``read(*args)`` (a LossCheck add or flush); a NaN/inf loss names its step and epoch."""
    try:
        read(*args)
    except NaNLossError as exc:
        raise NaNLossError(f"{exc} at global step {exc.step} (epoch {epoch})", exc.step) from None


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

    def exit(self, ckpts: CheckpointManager, global_step: int, *, save: bool) -> NoReturn:
        """Rank 0 writes an emergency checkpoint within the grace period (``ckpts.emergency``;
        ``save=False`` when this step's epoch-end one was just submitted); every rank exits 75.

        A non-zero rank can only exit: ps-lite cannot lose a worker, so rank 0 and the others block
        in their next step until the supervisor sees the exit code and stops the job; the retry
        resumes from the newest committed checkpoint (at most one cadence interval old).
        """
        assert self.requested_at is not None
        ckpts.emergency(global_step, self.requested_at, save=save)
        # os._exit, not SystemExit: the kvstore's destructor would wait in a ps-lite barrier for
        # workers that never reach it.
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # a broken pipe: the supervisor that read it is gone (common.procs.watchdog)
        os._exit(EXIT_PREEMPTED)


# -- export ---------------------------------------------------------------------------------------


def export(net: Any, manifest: dict[str, Any], model_prefix: str) -> None:
    """The hybridized model (symbol + params) and what serving needs to feed it, under ``model_prefix``."""
    with tempfile.TemporaryDirectory() as tmp:
        net.export(os.path.join(tmp, "model"), epoch=0)
        meta = {"feature_columns": manifest["feature_columns"], "classes": manifest["classes"],
                "input_shape": manifest.get("input_shape", []), "num_features": manifest["num_features"]}
        if is_regression(manifest):  # the pyfunc model returns one float column per target
            meta.update(task="regression", target_columns=manifest["target_columns"])
        with open(os.path.join(tmp, "model_meta.json"), "w") as fh:
            json.dump(meta, fh, indent=2)
        if manifest.get("preprocessing"):  # the served model applies it to raw rows
            with open(os.path.join(tmp, "preprocessing.json"), "w") as fh:
                json.dump(manifest["preprocessing"], fh, indent=2)
        for fname in sorted(os.listdir(tmp)):
            storage.upload_file(os.path.join(tmp, fname), storage.join(model_prefix, fname))
