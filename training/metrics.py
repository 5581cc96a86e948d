"""Throughput and step time of a worker: the progress line and the per-epoch figures.

The figures are this worker's samples per second of training-loop time (data already in
memory; evaluation and checkpoint waits at epoch ends included in the job figures only). In
``dist_sync`` every worker runs the same steps at the same pace (each push waits for all), so
the job's total is the worker's rate times the worker count (``samples_per_s_total``).
"""
from __future__ import annotations

import time

PROGRESS_EVERY_S = 5.0


class ThroughputMeter:
    def __init__(self, num_workers: int, started: float, every_s: float = PROGRESS_EVERY_S) -> None:
        self.num_workers = num_workers
        self.started = started
        self.every_s = every_s
        self.last_log = started
        self.samples = self.steps = 0
        self.epoch_started = started
        self.epoch_samples = self.epoch_steps = 0

    def start_epoch(self) -> None:
        self.epoch_started = time.monotonic()
        self.epoch_samples = self.epoch_steps = 0

    def count(self, samples: int) -> None:
        self.samples += samples
        self.steps += 1
        self.epoch_samples += samples
        self.epoch_steps += 1

    def due(self, now: float) -> bool:
        if now - self.last_log < self.every_s:
            return False
        self.last_log = now
        return True

    def line(self, epoch: int, step: int, steps: int, global_step: int, loss: float, remaining_steps: int,
             step_samples: int, now: float) -> str:
        rate = self.samples / max(now - self.started, 1e-9)
        eta = remaining_steps * step_samples / rate if rate else float("nan")
        return (f"epoch={epoch} step={step}/{steps} global_step={global_step} loss={loss:.4f} "
                f"samples/s={rate:.0f} total_samples/s={rate * self.num_workers:.0f} eta={eta:.0f}s")

    def epoch_metrics(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self.epoch_started, 1e-9)
        rate = self.epoch_samples / elapsed
        return {"samples_per_s_worker": rate, "samples_per_s_total": rate * self.num_workers,
                "step_time_s": elapsed / max(self.epoch_steps, 1)}

    def totals(self, now: float) -> dict[str, float]:
        elapsed = max(now - self.started, 1e-9)
        rate = self.samples / elapsed
        return {"samples_per_s_worker": rate, "samples_per_s_total": rate * self.num_workers,
                "step_time_s": elapsed / max(self.steps, 1)}
