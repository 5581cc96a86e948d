"""The best epoch so far and when to stop: early stopping on a validation metric.

Rank 0 evaluates the validation split at every epoch end (``training.loop.worker.end_epoch``)
and is the only worker that knows the metric, so it alone updates ``BestEpoch``; its stop
decision reaches every worker through the kvstore (``agree_to_stop``), so every worker ends at
the same global step and none waits for a push that never comes (ps-lite cannot lose a peer).

``BestEpoch`` is a pure function of the epoch records it has seen and the config, and it is part
of every checkpoint's train state (``to_state`` / ``from_state``): a job resumed at any step,
with the same or (elastic) another worker count, makes the same decisions as an uninterrupted
one, including "already stopped" when it resumes at the stopping epoch's checkpoint.
"""
from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from common.config import ConfigError, TrainConfig
from common.mx import import_mxnet
from training.loop.metrics import higher_is_better

__all__ = ["BestEpoch", "GO_ON", "PRUNE", "STOP_EARLY", "STOP_KEY_BASE", "agree", "agree_to_stop"]

log = logging.getLogger(__name__)

# Kvstore keys of the per-epoch stop decisions: STOP_KEY_BASE + epoch. Above every parameter
# key (a split model's stages start at multiples of training.loop.placement.KEY_STRIDE, at most
# 16 stages), and small enough that ps-lite's server choice for a key, key * 9973 in a C int,
# does not overflow for any epoch the config allows (tests/unit/test_early_stop.py checks both).
STOP_KEY_BASE = 200_000
# What rank 0 decided at an epoch end (``agree``): go on, stop early (patience ran out), or stop
# as a pruned sweep trial (training.loop.pruning).
GO_ON, STOP_EARLY, PRUNE = 0, 1, 2


@dataclass
class BestEpoch:
    """The best value of ``metric`` so far, where it was reached, and the epochs since."""

    metric: str
    higher: bool
    min_delta: float
    patience: int  # epochs without a new best before stopping; 0 = never stop
    value: float | None = None
    epoch: int | None = None
    step: int | None = None   # the global step of that epoch's end (its epoch-end checkpoint)
    bad_epochs: int = 0       # epochs since the best one
    stopped_at: int | None = None  # the epoch after which training stopped early

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> BestEpoch:
        o = cfg.optim
        return cls(metric=cfg.early_stopping_metric, higher=higher_is_better(cfg.early_stopping_metric),
                   min_delta=float(o.early_stopping_min_delta), patience=o.early_stopping_patience)

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best by more than ``min_delta`` (a NaN never does)."""
        if math.isnan(value):
            return False
        if self.value is None:
            return True
        gain = value - self.value if self.higher else self.value - value
        return gain > self.min_delta

    def update(self, record: dict[str, Any]) -> bool:
        """Take an epoch record (``epoch``, ``global_step`` and the metric); True if it is the new best."""
        if self.metric not in record:
            found = sorted(k for k in record if k.startswith("val_"))
            raise ConfigError(f"optim.early_stopping_metric={self.metric!r} is not a metric of this task's "
                             f"validation (it reports {found})")
        value = float(record[self.metric])
        if self.improves(value):
            self.value, self.epoch, self.step, self.bad_epochs = value, int(record["epoch"]), \
                int(record["global_step"]), 0
            return True
        self.bad_epochs += 1
        return False

    @property
    def patience_ran_out(self) -> bool:
        return self.patience > 0 and self.bad_epochs >= self.patience

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def tracking(cfg: TrainConfig) -> bool:
        """Whether a job tracks its best epoch: with early stopping on or the best epoch exported."""
        return cfg.optim.early_stopping_patience > 0 or cfg.exports_best

    @classmethod
    def restore(cls, cfg: TrainConfig, state: dict[str, Any] | None,
                history: list[dict[str, Any]]) -> BestEpoch:
        """The tracker a checkpoint recorded; for one that holds none (written while nothing was
        tracked: ``checkpoint.export_epoch`` may change on a resume) or one of another metric,
        replayed from its epoch records. The metric, its direction, min_delta and patience always come from ``cfg`` (the
        resume digest guarantees they are the ones the checkpoint was written with)."""
        fresh = cls.from_config(cfg)
        # A tracker of another metric (written when "auto" meant val_accuracy for classification)
        # is replayed from the epoch records, which hold every validation metric.
        if state and state.get("metric") == fresh.metric:
            return cls(**{**state, "metric": fresh.metric, "higher": fresh.higher, "min_delta": fresh.min_delta,
                          "patience": fresh.patience})
        for record in history:
            fresh.update(record)
        return fresh

    def summary(self, exported: str) -> dict[str, Any]:
        """What the job's metrics say about the selection: which epoch, metric and value, whether
        and when it stopped early, and which epoch's parameters were exported (``exported``)."""
        return {"metric": self.metric, "mode": "max" if self.higher else "min", "min_delta": self.min_delta,
                "patience": self.patience, "best_epoch": self.epoch, "best_value": self.value,
                "best_step": self.step, "stopped_at_epoch": self.stopped_at, "exported": exported}


def agree_to_stop(kv: Any, epoch: int, stop: bool, num_workers: int) -> bool:
    """Rank 0's ``stop`` for ``epoch``, on every worker (``agree`` of a yes or no)."""
    return agree(kv, epoch, STOP_EARLY if stop else GO_ON, num_workers) != GO_ON


def agree(kv: Any, epoch: int, decision: int, num_workers: int) -> int:
    """Rank 0's ``decision`` for ``epoch`` (``GO_ON``, ``STOP_EARLY``, ``PRUNE``), on every worker.

    The decision travels as a new kvstore key per epoch: ``init`` stores rank 0's value on a
    server (it is a copy there, never an optimizer update, wherever the optimizer runs) and
    ends in a barrier of every worker, after which each one pulls it. One barrier and one
    4-byte pull per epoch, only with early stopping on or at a pruning rung.
    """
    if num_workers == 1:
        return decision
    mx = import_mxnet()
    key = STOP_KEY_BASE + epoch
    kv.init(key, mx.nd.array([float(decision)]))
    agreed = mx.nd.zeros((1,))
    kv.pull(key, out=agreed)
    return int(round(float(agreed.asscalar())))
