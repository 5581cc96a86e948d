"""The optimizer a worker trains with: its name and parameters, and the learning-rate schedule.

Everything here is a function of the config, the job's worker count, the steps per epoch and
the global step, so a resumed job rebuilds the same optimizer at the same position:

- The schedule counts optimizer steps (one per ``trainer.step``, i.e. per ``accumulate_steps``
  micro-batches). MXNet's optimizer calls the scheduler with its ``num_update``, the largest
  per-parameter update count, which starts at ``begin_num_update``. A job built at global step
  ``g`` passes ``begin_num_update=g``, so the schedule continues where the checkpoint left it
  whether or not the optimizer state comes back: with the optimizer on the workers
  ``Trainer.load_states`` restores the pickled optimizer (its counts say the same ``g``); with
  it on the servers the servers receive this optimizer, already at ``g``.
- mx.lr_scheduler's MultiFactor scheduler keeps a cursor, but it catches up in a loop when
  first called at a later step, and Cosine/Poly are pure functions of ``num_update``; so a
  fresh scheduler at step ``g`` gives the same rate as one that counted up to ``g``
  (``tests/unit/test_optim.py``).
- No ``rescale_grad``: ``trainer.step(global_batch)`` sets it (gluon multiplies the two; a
  rescale here once made the gradient scale 1/global_batch**2, docs/kvstore-correctness.md).
"""
from __future__ import annotations

from typing import Any

from common.mx import import_mxnet
from common.config import ConfigError, TrainConfig


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    return cfg.optim.epochs * steps_per_epoch


def lr_scheduler(cfg: TrainConfig, num_workers: int, steps_per_epoch: int) -> Any | None:
    """The mx.lr_scheduler object of ``optim.lr_schedule`` (None for a constant rate, no warmup)."""
    mx = import_mxnet()
    o = cfg.optim
    lr = cfg.effective_learning_rate(num_workers)
    total = total_steps(cfg, steps_per_epoch)
    if o.warmup_steps >= total:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be below the {total} optimizer steps "
                          f"of this job ({o.epochs} epochs x {steps_per_epoch} steps)")
    warmup = {"base_lr": lr, "warmup_steps": o.warmup_steps, "warmup_begin_lr": 0.0, "warmup_mode": "linear"}
    if o.lr_schedule == "constant":
        if not o.warmup_steps:
            return None
        # A factor of 1 never changes the rate: warmup, then constant.
        return mx.lr_scheduler.FactorScheduler(step=total, factor=1.0, **warmup)
    if o.lr_schedule == "step":
        # The rate drops once the first step of each decay epoch has been taken (MultiFactor
        # compares num_update > step), i.e. from the first update of that epoch on.
        steps = [e * steps_per_epoch for e in o.lr_decay_epochs]
        if steps[0] <= o.warmup_steps:
            raise ConfigError(f"optim.lr_decay_epochs starts at step {steps[0]}, inside the warmup "
                              f"({o.warmup_steps} steps)")
        return mx.lr_scheduler.MultiFactorScheduler(step=steps, factor=o.lr_decay_factor, **warmup)
    if o.lr_schedule == "cosine":
        return mx.lr_scheduler.CosineScheduler(max_update=total, final_lr=o.final_lr, **warmup)
    if o.lr_schedule == "poly":
        return mx.lr_scheduler.PolyScheduler(max_update=total, pwr=o.poly_power, final_lr=o.final_lr, **warmup)
    raise ConfigError(f"unknown optim.lr_schedule {o.lr_schedule!r}")


def optimizer_params(cfg: TrainConfig, num_workers: int, steps_per_epoch: int, global_step: int) -> dict[str, Any]:
    """``gluon.Trainer`` optimizer parameters for a job at ``global_step`` (0 for a fresh one)."""
    o = cfg.optim
    params: dict[str, Any] = {"learning_rate": cfg.effective_learning_rate(num_workers), "wd": o.weight_decay,
                              "begin_num_update": global_step}
    if o.optimizer in ("sgd", "nag"):
        params["momentum"] = o.momentum
    scheduler = lr_scheduler(cfg, num_workers, steps_per_epoch)
    if scheduler is not None:
        params["lr_scheduler"] = scheduler
    if o.precision == "fp16":
        # fp32 master weights under float16 compute (what amp.init_trainer expects).
        params["multi_precision"] = True
    return params


def learning_rate_at(trainer: Any) -> float:
    """The rate of the latest update: the schedule at the current update count.

    MXNet's optimizer increments its count and then asks the scheduler, so update ``g`` (1-based)
    runs at ``scheduler(g)``; the next step will use ``scheduler(g + 1)``.
    """
    opt = trainer._optimizer
    if opt.lr_scheduler is None:
        return float(opt.lr)
    return float(opt.lr_scheduler(opt.num_update))


def reposition(trainer: Any, cfg: TrainConfig, num_workers: int, steps_per_epoch: int, global_step: int) -> None:
    """After ``Trainer.load_states``: the schedule again comes from the config and the global step.

    The restored optimizer carries the scheduler it was pickled with; replacing it keeps the
    rate a pure function of (config, worker count, global step) also across an elastic resume,
    where the scaled learning rate changes with the worker count. A split model's stages
    (``training.loop.placement.StagedTrainer``) each get their own scheduler, as when they were built.
    """
    for stage in getattr(trainer, "trainers", None) or [trainer]:
        opt = stage._optimizer
        if opt.num_update != global_step:
            raise RuntimeError(f"restored optimizer is at update {opt.num_update}, the checkpoint at step "
                               f"{global_step}")
        opt.lr = cfg.effective_learning_rate(num_workers)
        opt.lr_scheduler = lr_scheduler(cfg, num_workers, steps_per_epoch)
