"""One worker of a training job: set up → resume → {step, maybe checkpoint, maybe evaluate} → export.

Run as a role process by the launcher (``python -m training worker JOB_URI``) with the ps-lite
``DMLC_*`` variables set. Rank 0 is the only writer of checkpoints, metrics and the model.
``run`` reads top to bottom: ``join_kvstore`` (this worker's ``KVStoreTopology``: kvstore, rank,
contexts), ``build_data`` (shards), ``build_net`` (the model, seeded), ``resume.restore``
(parameters and position), ``build_loop`` (the ``Loop``: trainer, step runner, data order,
checkpoint manager, fault plan, preemption flag, throughput meter; the one object the loop's
functions take), ``train`` (each epoch's steps, then its end: evaluation, log lines, epoch-end
checkpoint), the final commit check and the export (``training.loop.export``). Validation is
``training.loop.validation``, SIGTERM handling ``training.loop.preemption``.

Besides its human log lines the loop emits structured events (``common.events``: worker started,
progress, epoch done with its record, first step after a resume); the supervisor's status record,
live tracking and the recovery timeline read those, never the human text.

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
``training.checkpoint.manager`` (the upload runs in the background, ``training.checkpoint.uploader``);
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
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common import fpmode, model_code, storage
from common.config import TrainConfig
from common.events import EpochDone, FirstStep, FirstStepAfterResume, Progress, WorkerStarted, emit
from common.manifest import load_manifest, num_outputs
from common.model_code import StagedCode
from common.mx import import_mxnet
from common.procs.watchdog import preempt_on_supervisor_loss
from training.checkpoint import state as ckpt_state
from training.checkpoint.manager import CheckpointManager
from training.checkpoint.state import Snapshot
from training.checkpoint.store import Checkpoint, CheckpointStore, store_for
from training.feed import data as feed_data
from training.feed.prefetch import prefetched
from training.launch.job import JobSpec
from training.loop import resume
from training.loop.early_stop import GO_ON, PRUNE, STOP_EARLY, agree
from training.loop.validation import evaluate
from training.loop.export import export, load_best
from training.loop.faults import FaultPlan
from training.loop.kvstore_sync import make_trainer, with_gradient_compression
from training.loop.metrics import StepRecorder, ThroughputMeter
from training.loop.model import build_model, draws_random
from training.loop.optim import learning_rate_at, optimizer_params
from training.loop.placement import SplitNet, make_split_trainer
from training.loop.preemption import Preemption
from training.loop.pruning import Pruner
from training.loop.resume import TrainState, resume_digest
from training.loop.step import LossCheck, NaNLossError, StepRunner, contexts, init_amp, make_loss, prepare

__all__ = ["NaNLossError", "run", "resume_digest"]

log = logging.getLogger(__name__)


def run(job: JobSpec) -> dict[str, Any]:
    faults = FaultPlan.from_settings()  # read once: the loop only compares step numbers with it
    cfg = job.config
    if job.model_code_uri:  # before anything builds the network: a bad archive fails the role at once
        model_code.activate(StagedCode(job.model_code_uri, job.model_code_sha256))
    topology = join_kvstore(cfg)
    preemption = Preemption.install()
    if topology.rank == 0:  # its supervisor's loss is a preemption: the emergency checkpoint first
        preempt_on_supervisor_loss(cfg.checkpoint.preempt_grace_s)
    data = build_data(job, topology)
    model = build_net(cfg, data.manifest, topology.ctxs)
    # A fault plan's torn checkpoint: the writer dies between data files and manifest (only rank 0 saves).
    store = store_for(job.checkpoint_prefix, cfg.checkpoint, before_commit=faults.before_commit_hook())
    state, ckpt = resume.restore(store, job, model.net, topology.ctxs[0], topology.num_workers, data.steps,
                                 data.manifest)
    loop = build_loop(cfg, topology, data, model, state, ckpt,
                      store=store, faults=faults, preemption=preemption, code_sha256=job.model_code_sha256)
    loop.pruner = Pruner.from_job(job.pruning)
    train(loop)
    result = loop.result()
    stats = loop.ckpts.finish(state.global_step)  # raises if the final checkpoint was not committed
    if stats is not None:
        result["checkpoint"] = stats
    if topology.rank == 0:
        if cfg.exports_best:
            load_best(model.net, store, state, topology.ctxs[0])
        export(model.net, data.manifest, job.model_prefix)
        storage.put_bytes(job.metrics_uri, json.dumps(result, indent=2).encode())
        log.info("model exported to %s", job.model_prefix)
    return result


# -- set up ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVStoreTopology:
    """This worker's view of the kvstore: the handle, its rank among the workers, and its devices."""

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
    val: Any  # rank 0's validation split, memory-mapped, targets unscaled (a ShardSet); None on other ranks


@dataclass(frozen=True)
class Model:
    net: Any  # a gluon block, or a SplitNet over the contexts
    split: bool
    use_amp: bool
    reseed_mxnet: bool  # whether the net draws MXNet random numbers (see ckpt_state.reseed: 1.9 ms a step)


def join_kvstore(cfg: TrainConfig) -> KVStoreTopology:
    mx = import_mxnet()
    kv = mx.kv.create(cfg.cluster.kvstore)
    ctxs = contexts(cfg)
    log.info("worker %d/%d started (kvstore=%s) optimizer on the %s; contexts %s; denormals %s", kv.rank,
             kv.num_workers, cfg.cluster.kvstore, cfg.cluster.optimizer_placement, ctxs,
             "flushed to zero" if fpmode.flushing() else "kept (IEEE)")
    emit(WorkerStarted(rank=kv.rank, num_workers=kv.num_workers))
    return KVStoreTopology(kv=kv, rank=kv.rank, num_workers=kv.num_workers, ctxs=ctxs)


def build_data(job: JobSpec, topology: KVStoreTopology) -> Data:
    cfg = job.config
    manifest = load_manifest(job.shards_prefix)
    steps = feed_data.steps_per_epoch(manifest, topology.num_workers, _step_rows(cfg))
    with tempfile.TemporaryDirectory(prefix="mxpipe-shards-") as work_dir:
        # Mapped, not loaded; readable after work_dir is removed (training.feed.shard_reader).
        rows = feed_data.open_split(manifest, job.shards_prefix,
                                    feed_data.shards_for_rank(manifest, topology.rank, topology.num_workers),
                                    work_dir)
        val = None
        if topology.rank == 0:
            val_shards = [s for s in manifest["shards"] if s["split"] == "val"]
            # Mapped like the train rows: memory follows evaluate's batch, not the split's size.
            val = feed_data.open_split(manifest, job.shards_prefix, val_shards, work_dir, scaled_targets=False)
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
    """The state of one worker's training: what the steps run on, built once the parameters are
    final (fresh or restored), and what acts between them (checkpoints, faults, preemption)."""

    cfg: TrainConfig
    topology: KVStoreTopology
    data: Data
    model: Model
    state: TrainState
    trainer: Any
    train_step: StepRunner
    order: feed_data.EpochOrder
    step_log: StepRecorder
    faults: FaultPlan
    preemption: Preemption
    resumed_from: int | None  # the checkpoint's step; None for a fresh start
    code_sha256: str = ""  # a custom network's staged code (JobSpec.model_code_sha256)
    pruner: Pruner | None = None  # a sweep trial's pruning at its rungs (JobSpec.pruning)
    # Made once the loop exists, since the manager snapshots it (``snapshot``); then the meter.
    ckpts: CheckpointManager = field(init=False)
    meter: ThroughputMeter = field(init=False)

    def snapshot(self, global_step: int) -> Snapshot:
        """What a checkpoint of the current state holds (the manager calls it when it saves)."""
        record = resume.train_record(self.state, self.step_log.records, self.cfg, self.topology.num_workers,
                                     self.data.manifest, self.code_sha256)
        return ckpt_state.snapshot(self.model.net, self.trainer, global_step, record)

    def result(self) -> dict[str, Any]:
        """The job's metrics (rank 0 writes them next to the model)."""
        return {"global_step": self.state.global_step, "resumed_from": self.resumed_from,
                "epochs": self.cfg.optim.epochs, "history": self.state.history,
                "step_history": self.step_log.records, "num_workers": self.topology.num_workers,
                **self.meter.totals(time.monotonic()),
                # This attempt's counts: one trainer.step (one push per parameter) per k micro-batches;
                # the worker-side optimizer's update count (None when it runs on the servers).
                "micro_batches": self.train_step.micro_batches, "optimizer_steps": self.train_step.optimizer_steps,
                "optimizer_updates": (int(self.trainer._optimizer.num_update)
                                      if self.cfg.cluster.optimizer_placement == "workers" else None),
                # Which epoch was selected and why (training.loop.early_stop); absent when not tracked.
                **({"best": self.state.best.summary("best" if self.cfg.exports_best else "last")}
                   if self.state.best is not None else {}),
                # A sweep trial stopped by its pruner: after which epoch (training.loop.pruning).
                **({"pruned": {"epoch": self.state.pruned_at, "metric": self.pruner.metric}}
                   if self.state.pruned_at is not None and self.pruner is not None else {})}


def build_loop(cfg: TrainConfig, topology: KVStoreTopology, data: Data, model: Model, state: TrainState,
               ckpt: Checkpoint | None, *, store: CheckpointStore, faults: FaultPlan, preemption: Preemption,
               code_sha256: str = "") -> Loop:
    """The trainer (with the checkpoint's optimizer state), the step runner, the data order, the
    checkpoint manager and the throughput meter."""
    num_workers, steps, net = topology.num_workers, data.steps, model.net
    resumed_from = state.global_step if ckpt is not None else None
    # Older checkpoints hold no step records: the per-step curve then starts at the resume.
    step_log = StepRecorder(cfg.checkpoint.step_metrics_every_n, cfg.checkpoint.max_step_metrics,
                            ckpt.state.get("step_history") if ckpt is not None else None, state.global_step)
    global_batch = cfg.global_batch(num_workers)
    kv = topology.kv
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
    resume.restore_optimizer(trainer, net, ckpt, state, cfg, num_workers, steps, topology.rank)
    prepare(net, trainer, cfg.optim.accumulate_steps, model.use_amp)
    train_step = StepRunner(net, trainer, make_loss(cfg.model),
                            topology.ctxs[:1] if model.split else topology.ctxs,
                            batch_size=cfg.optim.batch_size, accumulate_steps=cfg.optim.accumulate_steps,
                            global_batch=global_batch, use_amp=model.use_amp)
    order = feed_data.EpochOrder(data.rows.num_rows, steps, _step_rows(cfg), cfg.seed, topology.rank)
    loop = Loop(cfg=cfg, topology=topology, data=data, model=model, state=state, trainer=trainer,
                train_step=train_step, order=order, step_log=step_log, faults=faults, preemption=preemption,
                resumed_from=resumed_from, code_sha256=code_sha256)
    loop.ckpts = CheckpointManager(store, cfg.checkpoint, steps, loop.snapshot, rank=topology.rank,
                                   resumed_step=resumed_from)
    loop.meter = ThroughputMeter(num_workers, time.monotonic())
    return loop


# -- the loop -------------------------------------------------------------------------------------


def train(loop: Loop) -> None:
    """Every epoch left: its steps, then its end (evaluation, log line, epoch-end checkpoint)."""
    state, epochs = loop.state, loop.cfg.optim.epochs
    if loop.resumed_from is not None and (state.epoch >= epochs or state.stopped_early):
        # The previous attempt died after its final checkpoint (while exporting, or the task
        # was killed after the job): nothing is left to train, only the export is redone.
        log.info("resumed at the final step %d: nothing left to train, exporting again", state.global_step)
        mx = import_mxnet()  # the export needs one hybridized forward
        loop.model.net(mx.nd.zeros((1, loop.data.manifest["num_features"]), ctx=loop.topology.ctxs[0]))
    while state.epoch < epochs and not state.stopped_early:
        losses = train_epoch(loop)
        end_epoch(loop, losses)
        loop.ckpts.save(state.global_step, must=True)  # with the stop decision, so a resume there stops too
        if loop.preemption.requested:
            # The epoch-end checkpoint is the emergency one.
            loop.preemption.exit(loop.ckpts, state.global_step, save=False)


def train_epoch(loop: Loop) -> LossCheck:
    """The rest of the current epoch's steps; returns its losses (read up to its last step but
    one at most ``LOSS_CHECK_EVERY`` steps late)."""
    cfg, state, rank, steps = loop.cfg, loop.state, loop.topology.rank, loop.data.steps
    train_step, step_log, trainer, meter = loop.train_step, loop.step_log, loop.trainer, loop.meter
    ckpts, faults, preemption = loop.ckpts, loop.faults, loop.preemption
    seed, reseed_mxnet, epoch = cfg.seed, loop.model.reseed_mxnet, state.epoch
    first_after_resume = loop.resumed_from + 1 if loop.resumed_from is not None else None
    # A fresh start's first step: the mark the time to the first step is measured to (benchmarks/many_roles.py).
    first_fresh = 1 if loop.resumed_from is None else None
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
                     loop.resumed_from)
            emit(FirstStepAfterResume(global_step=global_step, resumed_from=loop.resumed_from))
        elif global_step == first_fresh:
            _checked(epoch, losses.flush)  # done means computed, not queued
            emit(FirstStep(global_step=global_step))
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
            emit(Progress(epoch=epoch, step=step + 1, steps=steps, global_step=global_step))
    return losses


def end_epoch(loop: Loop, losses: LossCheck) -> None:
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
              **loop.meter.epoch_metrics()}
    if loop.data.val is not None:  # rank 0
        record.update({f"val_{k}": v for k, v in evaluate(loop.model.net, loop.data.val, ctx=loop.topology.ctxs[0],
                                                           model=cfg.model,
                                                           targets=feed_data.target_scale(loop.data.manifest)).items()})
    state.history.append(record)
    remaining = (cfg.optim.epochs - state.epoch - 1) * steps
    eta_s = remaining * record["step_time_s"]
    log.info("epoch %d done: step=%d loss=%.4f samples/s=%.0f (all workers %.0f) eta=%.0fs %s", state.epoch,
             state.global_step, record["train_loss"], record["samples_per_s_worker"],
             record["samples_per_s_total"], eta_s, json.dumps(record))
    emit(EpochDone(epoch=state.epoch, global_step=state.global_step, record=record, epochs=cfg.optim.epochs,
                   eta_s=eta_s))
    track_best(loop, record)
    state.epoch, state.step_in_epoch = state.epoch + 1, 0


def track_best(loop: Loop, record: dict[str, Any]) -> None:
    """Rank 0 (the one that evaluated) updates the best epoch and, at a sweep trial's rung, asks
    its pruner; every worker takes rank 0's decision (go on, stop early, pruned), so all of them
    stop after the same step (training.loop.early_stop)."""
    state, best, topology, epoch = loop.state, loop.state.best, loop.topology, loop.state.epoch
    if best is not None and topology.rank == 0 and best.update(record):
        log.info("best epoch so far: %d (%s=%.6g, step %d)", epoch, best.metric, best.value, best.step)
    patience = best is not None and best.patience > 0
    rung = loop.pruner.rung(epoch + 1, loop.cfg.optim.epochs) if loop.pruner is not None else None
    if (not patience and rung is None) or epoch + 1 == loop.cfg.optim.epochs:  # nothing to decide: no barrier
        return
    decision = GO_ON
    if topology.rank == 0:
        if patience and best.patience_ran_out:
            decision = STOP_EARLY
        elif rung is not None and not loop.pruner.keeps(rung, record):
            decision = PRUNE
    decision = agree(topology.kv, epoch, decision, topology.num_workers)
    if decision == STOP_EARLY:
        best.stopped_at = epoch
        log.info("early stopping after epoch %d: %s has not improved by more than %g for %d epochs; best epoch %s",
                 epoch, best.metric, best.min_delta, best.patience,
                 f"{best.epoch} ({best.value:.6g})" if topology.rank == 0 else "on rank 0")
    elif decision == PRUNE:
        state.pruned_at = epoch
        log.info("pruned after epoch %d (rung %s): this sweep trial is not among the best at its rung", epoch, rung)


def _checked(epoch: int, read: Any, *args: Any) -> None:
    """``read(*args)`` (a LossCheck add or flush); a NaN/inf loss names its step and epoch."""
    try:
        read(*args)
    except NaNLossError as exc:
        raise NaNLossError(f"{exc} at global step {exc.step} (epoch {epoch})", exc.step) from None
