"""Checkpoint cadence from the numbers (``checkpoint.every_n_steps: "auto"``): Young/Daly.

Checkpointing every τ seconds costs C per checkpoint; a failure (one every M seconds on average,
``checkpoint.mtbf_s``) loses on average τ/2 of work. The τ that minimises the sum is Young's
sqrt(2·C·M), which Daly refined to sqrt(2·C·M)·(1 + sqrt(C/2M)/3 + C/18M) − C (for C < 2M; M
otherwise). That is what ``interval_s`` computes; for C ≪ M the two agree within a few percent.

C is measured, never configured: the time the training loop was blocked by one checkpoint
(snapshot, waiting for the upload in flight) plus the time its upload took (serialise, encrypt,
put, commit). The upload counts in full although it runs in the background: it shares the
machine's cores and link with training, and until it commits, the steps since the previous
checkpoint are still at risk. With one upload in flight, an interval shorter than one upload
would only skip saves, so the interval is at least the upload time. It is turned into steps with
the measured step time: the time between two periodic saves over the steps between them. Both
follow a read-back of the losses, which drains MXNet's asynchronous engine, so this is the real
step time (the Python loop alone runs up to ``training.loop.step.LOSS_CHECK_EVERY`` steps ahead of
the engine between read-backs); an interval that ends at an epoch-end save holds the evaluation
and is not used.

Until the first checkpoint's cost is known the interval is ``BOOTSTRAP_STEPS``. Costs and step
times are smoothed (exponential average, ``SMOOTHING``); the interval is re-planned when either
has drifted by more than ``DRIFT`` (25 %) from what the current plan used, and every plan is
logged with its inputs.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

BOOTSTRAP_STEPS = 10
DRIFT = 0.25
SMOOTHING = 0.3


def interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimum checkpoint interval (seconds of work between checkpoints) for a checkpoint
    costing ``cost_s`` and a mean time between failures ``mtbf_s``."""
    if cost_s <= 0:
        raise ValueError(f"checkpoint cost must be > 0 seconds, got {cost_s}")
    if mtbf_s <= 0:
        raise ValueError(f"mean time between failures must be > 0 seconds, got {mtbf_s}")
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


@dataclass(frozen=True)
class CadencePlan:
    """One choice of the interval and what it was made from (all seconds)."""

    every_n_steps: int
    interval_s: float
    blocked_s: float
    upload_s: float
    step_s: float
    mtbf_s: float

    @property
    def cost_s(self) -> float:
        return self.blocked_s + self.upload_s

    @classmethod
    def make(cls, blocked_s: float, upload_s: float, step_s: float, mtbf_s: float) -> CadencePlan:
        seconds = max(interval_s(blocked_s + upload_s, mtbf_s), upload_s)
        return cls(max(1, math.ceil(seconds / step_s)), seconds, blocked_s, upload_s, step_s, mtbf_s)

    def drifted(self, blocked_s: float, upload_s: float, step_s: float) -> bool:
        return (abs((blocked_s + upload_s) / self.cost_s - 1) > DRIFT
                or abs(step_s / self.step_s - 1) > DRIFT)

    def describe(self) -> str:
        return (f"every {self.every_n_steps} steps ({self.interval_s:.1f}s of training; Young/Daly with checkpoint "
                f"cost {self.cost_s:.3f}s = blocked {self.blocked_s:.3f}s + upload {self.upload_s:.3f}s, "
                f"MTBF {self.mtbf_s:.0f}s, step time {self.step_s * 1000:.1f}ms)")


class AutoCadence:
    """The measured inputs of the plan and the plan itself; ``every_n_steps`` is its interval."""

    def __init__(self, mtbf_s: float) -> None:
        self.mtbf_s = mtbf_s
        self.every_n_steps = BOOTSTRAP_STEPS
        self.plan: CadencePlan | None = None
        self.replans = 0
        self._blocked_s: float | None = None
        self._upload_s: float | None = None
        self._step_s: float | None = None

    def measured(self, blocked_s: float, upload_s: float | None, step_s: float | None) -> CadencePlan | None:
        """One checkpoint's blocked time and, when known, the mean duration of the uploads finished
        since the last call and the step time since the previous save; returns the new plan when
        it changed (logged), else None."""
        self._blocked_s = _smooth(self._blocked_s, blocked_s)
        self._upload_s = self._upload_s if upload_s is None else _smooth(self._upload_s, upload_s)
        self._step_s = self._step_s if step_s is None else _smooth(self._step_s, step_s)
        if self._upload_s is None or self._step_s is None or self._step_s <= 0:
            return None
        if self._blocked_s + self._upload_s <= 0:
            return None
        if self.plan is not None and not self.plan.drifted(self._blocked_s, self._upload_s, self._step_s):
            return None
        first = self.plan is None
        self.plan = CadencePlan.make(self._blocked_s, self._upload_s, self._step_s, self.mtbf_s)
        self.every_n_steps = self.plan.every_n_steps
        self.replans += 0 if first else 1
        log.info("checkpoint cadence (auto)%s: %s", "" if first else f", re-planned (drift > {DRIFT:.0%})",
                 self.plan.describe())
        return self.plan


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
