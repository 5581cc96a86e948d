"""A sweep trial's pruning at its rungs: asynchronous successive halving across trials.

Each trial of a sweep is its own job; they meet only in storage. At a rung epoch
(``common.sweep.rung_of``: ``min_epochs * eta**k``) rank 0 writes the trial's metric to
``<rungs_prefix>/<k>/trial-<i>.json`` and reads what the other trials wrote there so far; the
trial goes on when it is among the best ``max(1, n // eta)`` of them (``common.sweep.keeps_training``),
else it stops. A trial is never waited for: the first ones at a rung go on, a late poor one
stops (asynchronous, as ASHA). The decision reaches every worker through the early-stopping
agreement (``training.loop.early_stop.agree``), so all workers stop after the same step.

A record is keyed by the trial, so a resumed trial that reaches the rung again overwrites its
own record with the same value (its training is exactly replayed) instead of counting twice.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from common import storage
from common.sweep import keeps_training, rung_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pruner:
    """One trial's pruning settings (``JobSpec.pruning``)."""

    rungs_prefix: str
    trial: int
    min_epochs: int
    eta: int
    metric: str
    higher: bool

    @classmethod
    def from_job(cls, pruning: dict[str, Any]) -> Pruner | None:
        """The job's pruner, or None when it is not a pruned sweep trial."""
        if not pruning or int(pruning.get("min_epochs", 0)) <= 0:
            return None
        return cls(rungs_prefix=pruning["rungs_prefix"], trial=int(pruning["trial"]),
                   min_epochs=int(pruning["min_epochs"]), eta=int(pruning["eta"]), metric=pruning["metric"],
                   higher=bool(pruning["higher"]))

    def as_dict(self) -> dict[str, Any]:
        return {"rungs_prefix": self.rungs_prefix, "trial": self.trial, "min_epochs": self.min_epochs,
                "eta": self.eta, "metric": self.metric, "higher": self.higher}

    def rung(self, epochs_done: int, epochs: int) -> int | None:
        """The rung after ``epochs_done`` epochs, when it is one before the last epoch."""
        return rung_of(epochs_done, self.min_epochs, self.eta) if epochs_done < epochs else None

    def keeps(self, rung: int, record: dict[str, Any]) -> bool:
        """Rank 0 at a rung: write this trial's value there, and whether it goes on."""
        value = float(record.get(self.metric, math.nan))
        folder = storage.join(self.rungs_prefix, str(rung))
        own = storage.join(folder, f"trial-{self.trial}.json")
        storage.put_bytes(own, json.dumps({"trial": self.trial, "epoch": record["epoch"], "metric": self.metric,
                                           "value": value}).encode())
        others = [json.loads(storage.get_bytes(uri))["value"] for uri in storage.list_uris(folder + "/") if uri != own]
        keep = keeps_training(value, [float(v) for v in others], self.eta, self.higher)
        log.info("pruning rung %d (epoch %d): %s=%.6g against %d other trial(s) there: %s", rung, record["epoch"] + 1,
                 self.metric, value, len(others), "goes on" if keep else
                 f"not in the best 1/{self.eta}: pruned")
        return keep
