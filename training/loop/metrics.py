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


class StepRecorder:
    """Per-step training loss and learning rate: every ``every_n``-th global step, at most ``cap``.

    What is kept is a pure function of the global step, so a resumed job (which restores the
    records from its checkpoint, ``records``) ends with exactly the records of an uninterrupted
    one: the steps that are multiples of the stride, where the stride starts at ``every_n`` and
    doubles whenever more than ``cap`` records would be kept (every other record is then
    dropped). A run of S steps keeps between cap/2 and cap records, evenly spaced, whatever S.
    The loss is the one the loop already read for its NaN check: no extra host sync.
    """

    def __init__(self, every_n: int, cap: int, records: list[dict[str, float]] | None = None,
                 global_step: int = 0) -> None:
        self.every_n, self.cap = every_n, cap
        self.stride = every_n
        while global_step // self.stride > cap:
            self.stride *= 2
        # Records past global_step (none in a checkpoint written at that step) would be duplicates.
        self.records = [r for r in records or [] if r["step"] <= global_step and r["step"] % self.stride == 0]
        self._rates: dict[int, float] = {}  # learning rates of due steps whose loss is not read yet

    def due(self, global_step: int) -> bool:
        return global_step % self.stride == 0

    def note_rate(self, global_step: int, learning_rate: float) -> None:
        """A due step's learning rate, taken right after its update; recorded once its loss is read."""
        self._rates[global_step] = learning_rate

    def on_loss(self, global_step: int, loss: float) -> None:
        """``LossCheck``'s callback for every step it reads: records the due ones."""
        if global_step in self._rates:
            self.record(global_step, loss, self._rates.pop(global_step))

    def record(self, global_step: int, loss: float, learning_rate: float) -> None:
        self.records.append({"step": global_step, "train_loss": loss, "learning_rate": learning_rate})
        if len(self.records) > self.cap:
            self.stride *= 2
            self.records = [r for r in self.records if r["step"] % self.stride == 0]


# Whether a larger value of a validation metric is better, by the metric's name without "val_".
# Classification reports loss and accuracy (training.loop.worker.evaluate); a regression task
# reports rmse, mae and r2.
_HIGHER_IS_BETTER = {"accuracy": True, "r2": True, "loss": False, "rmse": False, "mae": False}


def higher_is_better(metric_name: str) -> bool:
    """The direction of ``metric_name`` (``val_accuracy``, ``loss``, ...): True when larger is better.
    An unknown name is a ValueError naming the known ones."""
    base = metric_name.removeprefix("val_")
    if base not in _HIGHER_IS_BETTER:
        known = ", ".join(f"val_{name}" for name in _HIGHER_IS_BETTER)
        raise ValueError(f"unknown validation metric {metric_name!r}: its direction is not known "
                         f"(known: {known})")
    return _HIGHER_IS_BETTER[base]
