"""Where a worker starts, and what of its position a checkpoint records.

- ``restore``: the newest valid checkpoint of this run (exact resume; another worker count is an
  elastic resume, ``elastic_position``), else another run's parameters (``warm_start``), else
  fresh. ``check_compatible`` refuses a checkpoint of another training (``resume_digest``);
  ``model_digest`` is the stricter digest of what decides a freshly trained model (an earlier
  run's registered model is reused only when it matches, ``training.tracking.reuse``).
- ``restore_optimizer``: the checkpoint's optimizer state into the trainer built at the
  resumed step (with the optimizer on the servers it restarts from zero, logged).
- ``train_record``: what a checkpoint holds besides parameters and optimizer state: the data
  position, metric history, the digests a resume checks and the RNG scheme
  (``training.checkpoint.state``).
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from common.config import ConfigError, TrainConfig
from common.manifest import manifest_digest
from common.events import Resumed, emit
from training.checkpoint import state as ckpt_state
from training.checkpoint.store import KEEP_STEP, Checkpoint, CheckpointStore, store_for
from training.launch.job import JobSpec
from training.loop.early_stop import BestEpoch
from training.loop.optim import reposition

__all__ = ["BEST_EPOCH", "RNG_SCHEME", "TrainState", "check_compatible", "elastic_position", "restore",
           "model_digest", "restore_optimizer", "resume_digest", "train_record", "warm_start"]

log = logging.getLogger(__name__)

# The train state's key for the best-epoch tracker (absent when nothing is tracked).
BEST_EPOCH = "best_epoch"
RNG_SCHEME = "per-step reseed of python/numpy/mxnet (mxnet only if the net draws) from sha256(seed:global_step:rank)"


@dataclass
class TrainState:
    """Where the loop is: what a checkpoint records of it, and a resume restores."""

    epoch: int = 0
    step_in_epoch: int = 0  # steps of ``epoch`` done: where its batches continue
    global_step: int = 0    # optimizer steps done
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per finished epoch
    best: BestEpoch | None = None  # the best validation epoch so far, when tracked (training.loop.early_stop)
    pruned_at: int | None = None  # the epoch after which a sweep trial was pruned (training.loop.pruning)

    @property
    def stopped_early(self) -> bool:
        return (self.best is not None and self.best.stopped_at is not None) or self.pruned_at is not None


def restore(store: CheckpointStore, job: JobSpec, net: Any, ctx: Any, num_workers: int, steps: int,
            manifest: dict[str, Any]) -> tuple[TrainState, Checkpoint | None]:
    """The parameters into ``net`` and the position to continue from; the checkpoint resumed, if any."""
    ckpt = store.latest()
    tracking = BestEpoch.tracking(job.config)
    if ckpt is None:
        if job.warm_start_prefix:
            warm_start(net, job.warm_start_prefix, job.config, ctx)
        return TrainState(best=BestEpoch.from_config(job.config) if tracking else None), None
    check_compatible(ckpt.state, job, num_workers, manifest)
    ckpt_state.load_params(net, ckpt.files[ckpt_state.PARAMS], ctx)
    history = ckpt.state["history"]
    best = BestEpoch.restore(job.config, ckpt.state.get(BEST_EPOCH), history) if tracking else None
    state = TrainState(epoch=ckpt.state["epoch"], step_in_epoch=ckpt.state["step_in_epoch"],
                       global_step=ckpt.state["global_step"], history=history, best=best,
                       pruned_at=ckpt.state.get(PRUNED_AT))
    if ckpt.state["num_workers"] != num_workers:
        state.step_in_epoch = elastic_position(ckpt.state, num_workers, steps)
    return state, ckpt


def restore_optimizer(trainer: Any, net: Any, ckpt: Checkpoint | None, state: TrainState, cfg: TrainConfig,
                      num_workers: int, steps: int, rank: int) -> None:
    """The checkpoint's optimizer state into ``trainer``, its schedule at the resumed step."""
    if ckpt is not None:
        restored = ckpt_state.restore_optimizer(trainer, net, ckpt.files, ckpt.state, ckpt.uri)
        if restored:
            reposition(trainer, cfg, num_workers, steps, state.global_step)
        log.info("resumed from step %d (epoch %d, step %d in epoch); optimizer state %s", state.global_step,
                 state.epoch, state.step_in_epoch, "restored" if restored else "restarts from zero")
        emit(Resumed(step=state.global_step, epoch=state.epoch, step_in_epoch=state.step_in_epoch))
    elif not ckpt_state.saves_optimizer_state(trainer) and rank == 0:
        log.warning("optimizer on the servers: checkpoints hold no optimizer state, a resume restarts it from zero")


# The train-state key of the epoch a pruned sweep trial stopped after (absent: not pruned).
PRUNED_AT = "pruned_at"
# The train-state key of a custom network's code digest (the staged archive's sha256).
CODE_SHA256 = "model_code_sha256"


def train_record(state: TrainState, step_records: list[dict[str, float]], cfg: TrainConfig, num_workers: int,
                 manifest: dict[str, Any], code_sha256: str = "") -> dict[str, Any]:
    """The train state a checkpoint of ``state`` holds (``restore`` and ``check_compatible`` read it).
    With the best epoch exported, it names that epoch's checkpoint as one retention must keep
    (``KEEP_STEP``)."""
    record = {"epoch": state.epoch, "step_in_epoch": state.step_in_epoch, "global_step": state.global_step,
              "history": state.history, "step_history": step_records, "config_digest": cfg.digest(),
              "resume_digest": resume_digest(cfg), "num_workers": num_workers,
              "global_batch": cfg.global_batch(num_workers), "manifest_digest": manifest_digest(manifest),
              "rng": RNG_SCHEME}
    if code_sha256:  # a custom network: its code is part of what was trained (check_compatible)
        record[CODE_SHA256] = code_sha256
    if state.pruned_at is not None:  # a resume there stops as well
        record[PRUNED_AT] = state.pruned_at
    if state.best is not None:
        record[BEST_EPOCH] = state.best.to_state()
        if cfg.exports_best and state.best.step is not None:
            record[KEEP_STEP] = state.best.step
    return record


def warm_start(net: Any, prefix: str, cfg: TrainConfig, ctx: Any) -> None:
    """Initialise the parameters (only: epoch, step and optimizer state start fresh) from the
    newest valid checkpoint under another run's prefix. Every worker loads the same bytes."""
    ckpt = store_for(prefix, cfg.checkpoint).latest()
    if ckpt is None:
        raise ConfigError(f"warm start: no valid checkpoint under {prefix}")
    ckpt_state.load_params(net, ckpt.files[ckpt_state.PARAMS], ctx)
    log.info("warm start: parameters from step %d of %s", ckpt.step, ckpt.uri)


def _resume_fields(cfg: TrainConfig) -> dict[str, Any]:
    """What ``resume_digest`` hashes: the config without the cadence, retention, encryption,
    timeouts or (elastic) the cluster size."""
    raw = cfg.digest_dict()
    raw.pop("checkpoint")
    raw["data"].pop("prefetch_batches")  # how far ahead batches are built does not change them
    for key in ("rare_label_action", "rare_label_rows", "rare_label_ratio"):  # validation only
        raw["data"].pop(key, None)
    if raw["model"]["placement"] == "replicated":  # left out when default: older checkpoints still match
        raw["model"].pop("placement")
    cluster = raw.pop("cluster")
    raw["cluster"] = {"kvstore": cluster["kvstore"], "optimizer_on": cfg.cluster.optimizer_placement}
    if cluster["gradient_compression"] != "none":  # left out when off: older checkpoints still match
        raw["cluster"].update(gradient_compression=cluster["gradient_compression"],
                              compression_threshold=cluster["compression_threshold"])
    return raw


def _digest(raw: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def resume_digest(cfg: TrainConfig) -> str:
    """The part of the config a checkpoint must match: what is trained and how, not the cadence,
    retention, encryption, timeouts or (elastic) the cluster size."""
    return _digest(_resume_fields(cfg))


def model_digest(cfg: TrainConfig) -> str:
    """The part of the config that decides the trained model: ``resume_digest``'s fields plus the
    two a resume may change on purpose but a fresh training may not. The worker count and the
    contexts per worker set the global batch, the data each worker reads and the learning-rate
    scaling (an elastic resume is a continuation, not the same training); which epoch's
    parameters are exported (``checkpoint.export_epoch`` resolved) is what gets registered.
    Left out, as for a resume: checkpoint cadence and retention, encryption, timeouts, the
    backend, the server count and prefetching (none of them changes a parameter)."""
    raw = _resume_fields(cfg)
    raw["cluster"].update(num_workers=cfg.cluster.num_workers, devices_per_worker=cfg.cluster.devices_per_worker)
    raw["exports_best"] = cfg.exports_best
    return _digest(raw)


def elastic_position(state: dict[str, Any], num_workers: int, steps: int) -> int:
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


def check_compatible(state: dict[str, Any], job: JobSpec, num_workers: int, manifest: dict[str, Any]) -> None:
    """Refuse a checkpoint written by another training or, unless elastic, another worker count."""
    cfg = job.config
    if "resume_digest" in state:
        ok = state["resume_digest"] == resume_digest(cfg)
    else:  # written before resume digests existed
        ok = state["config_digest"] == cfg.digest()
    if not ok:
        raise ConfigError(f"checkpoint was written with config {state['config_digest']}, "
                         f"this job's config is {cfg.digest()}: refusing to mix them")
    if state.get(CODE_SHA256, "") != job.model_code_sha256:
        raise ConfigError(f"checkpoint was written by the network code {state.get(CODE_SHA256) or '(none)'}, this "
                         f"job's model.code_uri holds {job.model_code_sha256 or '(none)'}: the network's code "
                         "changed, refusing to resume its parameters with other code")
    if state["num_workers"] != num_workers:
        if not cfg.checkpoint.elastic:
            raise ConfigError(f"checkpoint was written by {state['num_workers']} workers, this job has "
                             f"{num_workers}: set checkpoint.elastic=true to resume with another worker count")
        if "global_batch" not in state:
            raise ConfigError("checkpoint predates elastic resume (no global_batch recorded)")
    if state.get("manifest_digest") not in (None, manifest_digest(manifest)):
        log.warning("checkpoint was written over other shards (manifest %s, now %s)", state["manifest_digest"],
                    manifest_digest(manifest))
