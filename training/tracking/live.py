"""The DAG run's MLflow run while its training runs: epoch curves, role system metrics, cost, end state.

A supervisor (``training.launch.launcher.Supervisor``, through its ``JobObserver`` hook) calls,
from its own threads and never waiting on MLflow:

- ``start()`` as the job starts: a background thread finds the run by its find tags (the same
  ``airflow.dag_id`` / ``airflow.run_id`` tags ``register`` reuses it by, so the model lands in
  this run) or creates it, marks it RUNNING and hands its URL to ``on_run`` (the train task puts
  it in an XCom for the "MLflow run" link);
- ``on_line(role, line)`` for every line a role prints, of which it reads the events
  (``common.events``) only: rank 0 (the worker whose ``worker_started`` event says rank 0) sends
  each epoch's record in its ``epoch_done`` event, and the progress, epoch and first-step-after-
  resume events carry the global step (and the step resumed from). Workers stay free of MLflow:
  what is logged is what they already print;
- ``sync(pids)`` every poll: samples the local role process trees (``common.procs.usage``) at
  most every ``SAMPLE_S``; cheap when not due;
- ``restarted(restarts, without_progress, reason)`` after each restart of every role in place
  (``training.launch.restarts``): the counts go out as ``job.restarts`` and
  ``job.restarts_without_progress``;
- ``end(outcome, error)`` once: the last points, the cost metrics and a cost line in the log,
  the error text as the ``error`` tag, and the run ended FINISHED, FAILED or KILLED.

The thread sends what has accumulated every ``sync_s`` seconds (``MXPIPE_LIVE_SYNC_S``):
epoch metrics at ``step=epoch`` under the keys and steps ``register`` logs them with (which
skips points already there), ``system/<role>/cpu_percent`` and ``system/<role>/rss_megabytes``,
``progress.global_step`` and the running ``cost.*`` totals (``training.tracking.cost``), the
last three at ``step`` = seconds since the run started, unique across attempts. MLflow never
makes training fail: every MLflow error is logged and counted (``errors``), the points stay
queued for the next sync, and ``end`` waits for the thread at most ``END_WAIT_S``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from common.events import EpochDone, EventError, FirstStepAfterResume, Progress, WorkerStarted, parse_event
from common.procs.usage import UsageMeter
from training.tracking.cost import RunCost, summary
from training.tracking.mlflow_params import MAX_METRICS_PER_BATCH, chunked, metric_points

log = logging.getLogger(__name__)

SAMPLE_S = 1.0  # CPU-time sampling of the role trees (what a role uses after its last sample is lost)
END_WAIT_S = 60.0  # how long ``end`` waits for the last sync
MAX_QUEUED_POINTS = 100_000  # while MLflow is unreachable: the oldest points go first
ERROR_TAG_CHARS = 5000
# MLflow's run statuses for the supervisor's outcomes.
STATUSES = {"succeeded": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


class LiveRun:
    """One training attempt's view of its DAG run's MLflow run (see the module docstring)."""

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str, find_tags: Mapping[str, str],
                 tags: Mapping[str, str] | None = None, sync_s: float = 10.0, gpus_per_worker: int = 0,
                 on_run: Callable[[str], None] | None = None,
                 cost_extras: Callable[[], Mapping[str, float]] | None = None) -> None:
        if sync_s <= 0:
            raise ValueError(f"sync_s must be > 0, got {sync_s!r}")
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.find_tags, self.tags = dict(find_tags), dict(tags or {})
        self.sync_s, self.gpus_per_worker = sync_s, gpus_per_worker
        self.on_run, self.cost_extras = on_run, cost_extras
        self.run_id: str | None = None
        self.run_url = ""
        self.errors = 0
        self.meter = UsageMeter()
        self.cost = RunCost()
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []  # rank 0's epoch records not sent yet
        self._queued: list[tuple[str, float, int]] = []  # (key, value, step) not sent yet
        self._logged: set[tuple[str, int]] = set()  # epoch points the run already holds
        self._started_ms = 0
        self._last_sample = 0.0
        self._final_cost: dict[str, float] = {}
        self._rank0 = ""  # the role that is rank 0 (only it evaluates: its epoch records are the run's)
        self._restarts: tuple[int, int] | None = None  # the supervisor's in-place restarts, once there is one
        self._ending = threading.Event()
        self._outcome = ("failed", "")
        self._thread = threading.Thread(target=self._loop, name="mlflow-live", daemon=True)

    # -- the supervisor's calls (never block on MLflow) ------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def on_line(self, role: str, line: str) -> None:
        try:
            event = parse_event(line)
        except EventError as exc:
            log.warning("unreadable event from %s: %s", role, exc)
            return
        if isinstance(event, WorkerStarted):
            if event.rank == 0:  # ps-lite assigns the ranks: worker-0 need not be rank 0
                self._rank0 = role
            return
        if not isinstance(event, (Progress, EpochDone, FirstStepAfterResume)):
            return
        with self._lock:
            if isinstance(event, FirstStepAfterResume):
                self.cost.resumed_from(event.resumed_from)
            self.cost.at_step(event.global_step)
            if isinstance(event, EpochDone) and role == self._rank0:
                self._records.append(dict(event.record))

    def sync(self, pids: Mapping[str, int]) -> None:
        now = time.monotonic()
        if now - self._last_sample < SAMPLE_S:
            return
        self._last_sample = now
        trees = self.meter.sample(pids)
        with self._lock:
            self.cost.core_seconds = {role: usage.core_seconds for role, usage in trees.items()}
            if self.gpus_per_worker:
                self.cost.gpu_seconds = {role: usage.seconds_alive * self.gpus_per_worker
                                         for role, usage in trees.items() if role.startswith("worker-")}

    def restarted(self, restarts: int, without_progress: int, reason: str) -> None:
        with self._lock:
            self._restarts = (restarts, without_progress)
        log.info("MLflow: job.restarts %d (%d in a row without a new checkpoint) after: %s", restarts,
                 without_progress, reason)

    def end(self, outcome: str, error: str = "") -> None:
        """End the attempt (``outcome``: succeeded, failed or stopped); waits at most ``END_WAIT_S``."""
        if outcome not in STATUSES:
            raise ValueError(f"outcome must be one of {sorted(STATUSES)}, got {outcome!r}")
        self._outcome = (outcome, error)
        self._ending.set()
        if self._thread.is_alive():
            self._thread.join(END_WAIT_S)
            if self._thread.is_alive():
                log.warning("MLflow live tracking did not finish within %.0fs; the run may stay RUNNING",
                            END_WAIT_S)

    # -- the MLflow thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        from mlflow import MlflowClient

        from training.tracking.runs import bounded_mlflow_env

        client = MlflowClient(self.tracking_uri)
        while True:
            ending = self._ending.wait(self.sync_s)
            if ending:
                self._guarded("add the instance cost", self._close_cost)
            with bounded_mlflow_env():
                self._guarded("open the run", lambda: self.run_id or self._open(client))
                if self.run_id:
                    self._guarded("log metrics", lambda: self._send(client, final=ending))
                    if ending:
                        self._guarded("end the run", lambda: self._finish(client))
            if ending:
                if self.errors:
                    log.warning("MLflow live tracking: %d call(s) failed (training was not affected)",
                                self.errors)
                return

    def _guarded(self, what: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception as exc:  # an MLflow outage must not end the training
            self.errors += 1
            log.warning("MLflow live tracking could not %s (%d error(s) so far): %s", what, self.errors, exc)

    def _open(self, client: Any) -> None:
        from training.tracking.runs import open_run, run_url

        run = open_run(client, experiment=self.experiment, run_name=self.run_name, find_tags=self.find_tags,
                       tags=self.tags)
        client.update_run(run.info.run_id, status="RUNNING")
        latest = run.data.metrics
        # Epoch points an earlier attempt (or register) logged, so a repeated epoch is not a second point.
        for key in latest:
            if not key.startswith(("system/", "progress.", "cost.")) and not key.endswith("_step"):
                self._logged.update((key, m.step) for m in client.get_metric_history(run.info.run_id, key))
        with self._lock:
            carried = RunCost.from_run(latest)
            carried.core_seconds, carried.gpu_seconds = self.cost.core_seconds, self.cost.gpu_seconds
            carried.start_step, carried.reached = self.cost.start_step, self.cost.reached
            self.cost = carried
        self._started_ms = run.info.start_time
        self.run_id, self.run_url = run.info.run_id, run_url(self.tracking_uri, run.info.experiment_id,
                                                             run.info.run_id)
        log.info("MLflow run of this training: %s", self.run_url)
        if self.on_run is not None:
            self.on_run(self.run_url)

    def _close_cost(self) -> None:
        """The attempt's last cost figures (with ``cost_extras``, e.g. instance-hours), and their line."""
        with self._lock:
            final = self.cost.metrics()
        try:
            if self.cost_extras is not None:
                final.update(self.cost_extras())
        finally:
            self._final_cost = final
            log.info("%s", summary(final))

    def _points(self, final: bool) -> list[tuple[str, float, int]]:
        """Move what has accumulated into the send queue: epoch records, system, progress, cost."""
        step = max(int(time.time() - self._started_ms / 1000), 0)
        with self._lock:
            records, self._records = self._records, []
            cost = self._final_cost if final and self._final_cost else self.cost.metrics()
            reached = self.cost.reached
            restarts = self._restarts
        points, _ = metric_points(records, {})
        fresh = [p for p in points if (p[0], p[2]) not in self._logged]
        self._logged.update((k, s) for k, _, s in fresh)
        for role, usage in self.meter.trees.items():
            fresh += [(f"system/{role}/cpu_percent", usage.cpu_percent, step),
                      (f"system/{role}/rss_megabytes", usage.rss_bytes / 2**20, step)]
        fresh += [("progress.global_step", float(reached), step)] + [(k, v, step) for k, v in cost.items()]
        if restarts is not None:
            fresh += [("job.restarts", float(restarts[0]), step),
                      ("job.restarts_without_progress", float(restarts[1]), step)]
        self._queued = (self._queued + fresh)[-MAX_QUEUED_POINTS:]
        return self._queued

    def _send(self, client: Any, *, final: bool) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        for batch in chunked(self._points(final), MAX_METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=[Metric(k, v, now, s) for k, v, s in batch], synchronous=True)
            self._queued = self._queued[len(batch):]

    def _finish(self, client: Any) -> None:
        outcome, error = self._outcome
        if error:
            client.set_tag(self.run_id, "error", error[-ERROR_TAG_CHARS:])
        client.set_terminated(self.run_id, status=STATUSES[outcome])


def live_run_for(tracking: Mapping[str, Any], *, gpus_per_worker: int = 0,
                 cost_extras: Callable[[], Mapping[str, float]] | None = None) -> LiveRun | None:
    """The live run a job document's ``tracking`` section asks for (``JobSpec.tracking``, written
    by the training task), or None when it is empty (tracking off)."""
    if not tracking:
        return None
    return LiveRun(tracking_uri=tracking["tracking_uri"], experiment=tracking["experiment"],
                   run_name=tracking["run_name"], find_tags=tracking["find_tags"], tags=tracking.get("tags"),
                   sync_s=float(tracking.get("sync_s", 10.0)), gpus_per_worker=gpus_per_worker,
                   cost_extras=cost_extras)


def open_run_url(tracking: Mapping[str, Any]) -> str:
    """Find or create the run ``tracking`` names (by its find tags) and return its URL: the
    training task opens it before the job starts, so the "MLflow run" link works at once."""
    from mlflow.tracking import MlflowClient

    from training.tracking.runs import bounded_mlflow_env, open_run, run_url

    with bounded_mlflow_env():
        client = MlflowClient(tracking["tracking_uri"])
        run = open_run(client, experiment=tracking["experiment"], run_name=tracking["run_name"],
                       find_tags=tracking["find_tags"], tags=tracking.get("tags") or {})
    return run_url(tracking["tracking_uri"], run.info.experiment_id, run.info.run_id)
