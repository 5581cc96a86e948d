"""What a run consumed, as MLflow metrics: core-seconds per role, GPU-seconds, recomputation.

Pure arithmetic (no MLflow, no psutil): ``training.tracking.live`` feeds it what the supervisor
saw and logs ``metrics()``; the totals of earlier attempts of the same run come back from the
run's own latest metric values (``RunCost.carried``), so a retried run's figures are the sum over
its attempts, including one whose task died without ending the run (the totals are logged at
every sync, not only at the end).

Recomputation: an attempt that resumes from step R after an earlier attempt reached step H
trains the steps R+1 … H again. ``steps_recomputed`` sums ``min(H, reached) - R`` over the
attempts, ``steps_trained`` sums ``reached - R``; ``recompute_share`` is their ratio and
``recompute_core_seconds`` that share of the core-seconds. The steps reached come from the
workers' events (``common.events``: progress every few seconds, epoch ends, the first step after
a resume, which also names R), so H is a lower bound by at most one progress interval
(``training.loop.metrics.PROGRESS_EVERY_S``) of steps.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PREFIX = "cost."
CORE_SECONDS = "cost.core_seconds"
GPU_SECONDS = "cost.gpu_seconds"


@dataclass
class RunCost:
    """The run's totals: ``carried`` from earlier attempts plus this attempt's."""

    carried: dict[str, float] = field(default_factory=dict)
    core_seconds: dict[str, float] = field(default_factory=dict)  # this attempt, by role
    gpu_seconds: dict[str, float] = field(default_factory=dict)
    start_step: int = 0
    reached: int = 0

    @classmethod
    def from_run(cls, latest: Mapping[str, float]) -> "RunCost":
        """Continue the totals of a run's latest ``cost.*`` metric values."""
        return cls(carried={k: float(v) for k, v in latest.items() if k.startswith(PREFIX)})

    def at_step(self, global_step: int) -> None:
        self.reached = max(self.reached, global_step)

    def resumed_from(self, step: int) -> None:
        self.start_step = step
        self.reached = max(self.reached, step)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, per_role in ((CORE_SECONDS, self.core_seconds), (GPU_SECONDS, self.gpu_seconds)):
            roles = {k.removeprefix(name + "."): v for k, v in self.carried.items() if k.startswith(name + ".")}
            for role, value in per_role.items():
                roles[role] = roles.get(role, 0.0) + value
            out.update({f"{name}.{role}": value for role, value in roles.items()})
            if roles:
                out[name] = sum(roles.values())
        highest_before = int(self.carried.get("cost.highest_step", 0))
        trained = self.carried.get("cost.steps_trained", 0.0) + max(self.reached - self.start_step, 0)
        recomputed = (self.carried.get("cost.steps_recomputed", 0.0)
                      + max(min(highest_before, self.reached) - self.start_step, 0))
        share = recomputed / trained if trained else 0.0
        out.update({"cost.highest_step": max(highest_before, self.reached), "cost.steps_trained": trained,
                    "cost.steps_recomputed": recomputed, "cost.recompute_share": share,
                    "cost.recompute_core_seconds": share * out.get(CORE_SECONDS, 0.0)})
        return out


def summary(metrics: Mapping[str, float]) -> str:
    """One log line of a run's cost metrics."""
    roles = " ".join(f"{k.removeprefix(CORE_SECONDS + '.')}={v:.1f}" for k, v in sorted(metrics.items())
                     if k.startswith(CORE_SECONDS + "."))
    line = (f"run cost: core-seconds {metrics.get(CORE_SECONDS, 0.0):.1f} ({roles or 'no local role sampled'}), "
            f"recomputation {metrics['cost.recompute_share']:.3f} of {metrics['cost.steps_trained']:.0f} steps "
            f"({metrics['cost.recompute_core_seconds']:.1f} core-seconds)")
    if GPU_SECONDS in metrics:
        line += f", GPU-seconds {metrics[GPU_SECONDS]:.1f}"
    if "cost.instance_hours" in metrics:
        line += f", instance-hours {metrics['cost.instance_hours']:.3f}"
    if "cost.usd" in metrics:
        line += f", USD {metrics['cost.usd']:.2f}"
    return line
