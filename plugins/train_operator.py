"""The training task: a durable, deferrable operator around a detached supervisor.

``TrainJobOperator`` is Airflow 3.3's ``ResumableJobMixin`` + ``BaseOperator`` in deferrable
mode:

- ``submit_job`` writes the attempt's job document and starts ``python -m training supervise``
  detached on the cluster (``infra`` ``Cluster.start_supervisor``); the job pointers it returns
  (job id, status URI, …) are the external id the mixin keeps in ``task_state_store``, so a
  retry, or an attempt after the worker died, finds the job again.
- ``poll_until_complete`` defers to ``TrainJobTrigger`` (``plugins.train_trigger``): while
  training runs the task is ``deferred`` and holds no worker slot. The trigger relays the job's
  log (shipped to storage by its supervisor: ``common.job_log``) into this task's log as it
  grows, each epoch as one line (loss, validation metrics, throughput, ETA). With ``deferrable=False`` (a
  deployment without a triggerer: ``MXPIPE_TRAIN_DEFERRABLE=0``) the task polls the same record
  itself, with the trigger's rules, and holds its slot for the whole training; the mixin still
  makes it durable: a retry after the worker died reconnects to the job.
- A retry whose stored job is still live reconnects to it (the mixin's ``is_job_active``); one
  whose job succeeded returns its result; otherwise a fresh job starts, which resumes from the
  newest committed checkpoint. ``submit_job`` itself refuses to start a second job while the
  status record shows a live one (whatever ``task_state_store`` says), and stops the leftovers of
  one whose supervisor died before it starts another; the supervisor refuses as well.
- ``execute_complete`` maps the end: ``succeeded`` → the dict ``train`` always returned;
  ``failed`` and deterministic (bad input, NaN) → ``AirflowFailException``; a stale heartbeat →
  the job is stopped as a stall and the task retried; anything else → retried.

Stopping: ``on_kill`` (the task process told to stop while not deferred) and the trigger's
``on_kill`` (a deferred task marked failed or cleared) stop the job; the deferral carries the
task's ``execution_timeout`` (counted from the job's start, so a reconnect does not reset it),
and when it passes the job is stopped and the task fails without a retry. Every stop is SIGTERM
to the supervisor: rank 0's emergency checkpoint within ``checkpoint.preempt_grace_s``, then
every role; SIGKILL after ``preempt_grace_s + STOP_MARGIN_S``. The teardown task stops the job
too (``plugins.pipeline_tasks.teardown``).
"""
from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, ResumableJobMixin

from plugins.failures import fail_without_retry

if TYPE_CHECKING:
    from airflow.sdk import Context

# A stop's bound beyond the emergency checkpoint's grace: the supervisor stopping the other
# roles (STOP_GRACE_S each) and its last status write.
STOP_MARGIN_S = 30.0
# The default read interval of the job's status record (settings: MXPIPE_TRAIN_POLL_S).
POLL_S = 2.0


class TrainingFailed(RuntimeError):
    """The training job ended without success in a way a retry may fix (retryable)."""


class TrainJobOperator(ResumableJobMixin, BaseOperator):
    """Train on the provisioned cluster: a detached supervised job, polled while deferred."""

    external_id_key = "train_job"
    template_fields = ("cluster", "shards", "config", "trial", "warm_start")

    def __init__(self, *, cluster: Any, shards: Any, config: Any = None, trial: Any = None, warm_start: Any = None,
                 poll_s: float = POLL_S, stale_after_s: float | None = None, deferrable: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if (config is None) == (trial is None):
            raise ValueError("give the run's config, or a sweep trial (which carries its own), not both")
        # Checked here, when the DAG file is parsed: an attempt never resolves the warm start itself.
        if (config is None) != (warm_start is None):
            raise ValueError("give the run's config with the run's warm start resolution (check_reuse's XCom); "
                             "a sweep trial carries its own")
        if not poll_s > 0:
            raise ValueError(f"poll_s must be a number of seconds > 0, got {poll_s!r}")
        self.cluster = cluster
        self.shards = shards
        self.config = config
        # A sweep trial (plugins.sweep_tasks.plan_trials): its config, run key, pruning, MLflow tags
        # and the sweep's warm start, resolved once for every trial by plan_trials.
        self.trial = trial
        # The reuse check's warm start ({"reference", "checkpoint"}: plugins.pipeline_tasks.check_reuse),
        # loaded by every attempt; None for a sweep trial, which carries its own.
        self.warm_start = warm_start
        self.poll_s = poll_s
        self.deferrable = deferrable
        self.stale_after_s = stale_after_s
        self._job: dict[str, Any] | None = None

    # -- helpers ----------------------------------------------------------------------------

    def _config(self) -> Any:
        return self.trial["config"] if self.trial is not None else self.config

    def _warm_start(self) -> Any:
        """The run's one resolution of its warm start (``{"reference", "checkpoint"}``), which
        every attempt loads: the reuse check's, or the sweep's (in the trial)."""
        return self.trial["warm_start"] if self.trial is not None else self.warm_start

    def _run_key(self, context: Context) -> str:
        """What names the job's storage, cluster and MLflow run: the DAG run, or the sweep trial."""
        return self.trial["run_id"] if self.trial is not None else context["run_id"]

    def _stop_grace_s(self) -> float:
        from plugins.pipeline_tasks import load_config

        return float(load_config(self._config()).checkpoint.preempt_grace_s) + STOP_MARGIN_S

    def _stale_after_s(self) -> float:
        from training.launch.status import STALE_AFTER_S

        return self.stale_after_s if self.stale_after_s is not None else STALE_AFTER_S

    def _stop(self, job: dict[str, Any], why: str) -> list[str]:
        from plugins.train_trigger import stop_job

        self.log.warning("stopping job %s: %s", job["job_id"], why)
        stopped = stop_job(job["cluster"], self._stop_grace_s())
        self.log.info("job %s stopped (%s)", job["job_id"], stopped)
        return stopped

    def _status(self, job: dict[str, Any]) -> Any:
        from training.launch.status import read_status

        return read_status(job["status_uri"])

    # -- ResumableJobMixin ------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        from plugins.connections import task_environment

        with task_environment(context["params"]):
            return self.execute_resumable(context)

    def submit_job(self, context: Context) -> dict[str, Any]:
        from common.job_log import log_prefix
        from plugins.connections import supervisor_env
        from plugins.pipeline_tasks import LIVE_RUN_XCOM_KEY, open_live_run, prepare_job
        from infra.cluster import attach

        dag_id, run_id, try_number = context["dag"].dag_id, self._run_key(context), context["ti"].try_number
        trial = self.trial or {}
        job = prepare_job(self._config(), self.cluster, self.shards, dag_id, run_id, try_number,
                          warm_start=self._warm_start(), pruning=trial.get("pruning"),
                          tracking_tags=trial.get("tracking_tags"))
        current = self._status(job)
        if current is not None and current.live(stale_after_s=self._stale_after_s()):
            # task_state_store lost the id (a crash between submit and persist): never a second job.
            self.log.warning("job %s is still live on this run's checkpoint prefix; reconnecting to it",
                             current.job_id)
            return {**job, "job_id": current.job_id, "submitted_at": current.started_at}
        if current is not None and current.active:
            self._stop({**job, "job_id": current.job_id}, f"its supervisor on {current.host} is gone "
                                                           f"(heartbeat {current.age_s():.0f}s ago)")
        job_id = f"{try_number}-{uuid.uuid4().hex[:12]}"
        job = {**job, "job_id": job_id, "submitted_at": time.time()}
        # The DAG run's MLflow run exists from the start (its link works during training); the
        # supervisor's live run finds it by the same tags.
        if url := open_live_run(job):
            context["ti"].xcom_push(key=LIVE_RUN_XCOM_KEY, value=url)
        where = attach(job["cluster"]).start_supervisor(job["job_uri"], job_id=job_id, attempt=try_number,
                                                        env=supervisor_env(os.environ))
        # The job's log is read from storage (shipped by its supervisor), never from a file on the
        # supervisor's host, which a reader of this task's log cannot reach.
        self.log.info("started training job %s (supervisor on %s); its log: %s/ (relayed here as it grows)",
                      job_id, where["host"], log_prefix(job["status_uri"], job_id))
        self._job = job
        return job

    def get_job_status(self, external_id: Any, context: Context) -> str:
        status = self._status(external_id)
        if status is None or status.job_id != external_id["job_id"]:
            return "unknown"
        if status.active and not status.live(stale_after_s=self._stale_after_s()):
            return "stale"
        return status.state

    def is_job_active(self, status: str) -> bool:
        from training.launch.status import ACTIVE_STATES

        return status in ACTIVE_STATES

    def is_job_succeeded(self, status: str) -> bool:
        from training.launch.status import SUCCEEDED

        return status == SUCCEEDED

    def _trigger(self, job: dict[str, Any], context: Context) -> Any:
        from plugins.connections import aws_conn_id
        from plugins.train_trigger import TrainJobTrigger

        return TrainJobTrigger(job=job, cluster=job["cluster"], aws_conn_id=aws_conn_id(context["params"]),
                               poll_s=self.poll_s, stale_after_s=self._stale_after_s(),
                               stop_grace_s=self._stop_grace_s(), relay_try=getattr(context.get("ti"), "try_number", 0) or 0)

    def poll_until_complete(self, external_id: Any, context: Context) -> Any:
        self._job = external_id
        trigger = self._trigger(external_id, context)
        if not self.deferrable:
            return self.execute_complete(context, self._poll_here(trigger))
        timeout = None
        if self.execution_timeout is not None:
            elapsed = time.time() - float(external_id["submitted_at"])
            timeout = max(self.execution_timeout - timedelta(seconds=elapsed), timedelta(seconds=1))
        self.defer(trigger=trigger, method_name="execute_complete", timeout=timeout)

    def _poll_here(self, trigger: Any) -> dict[str, Any]:
        """The trigger's event, polled in this task process (it holds its worker slot meanwhile);
        the task's ``execution_timeout`` is Airflow's own here, and ``on_kill`` stops the job."""
        from plugins.train_trigger import JobStorage

        store = JobStorage(trigger.aws_conn_id)  # one client (one credential lookup) for the whole poll
        while True:
            try:
                read = trigger.read(store)
            except Exception as exc:  # noqa: BLE001 - storage trouble: the next read decides, as in the trigger
                self.log.warning("could not read %s: %s", trigger.job["status_uri"], exc)
            else:
                if (event := trigger.step(read, self.log)) is not None:
                    return event.payload
            time.sleep(self.poll_s)

    def get_job_result(self, external_id: Any, context: Context) -> dict[str, Any]:
        from plugins.connections import task_environment
        from training.train_job import job_result

        with task_environment(context["params"]):
            return job_result(external_id)

    # -- the end ----------------------------------------------------------------------------

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        from training.launch.status import FAILED, SUCCEEDED

        # The event carries the job: a resumed task's kwargs are the event alone (dag.test()).
        job, state, status = event["job"], event["state"], event.get("status") or {}
        if state == SUCCEEDED:
            return self.get_job_result(job, context)
        if state == FAILED and status.get("deterministic"):
            raise fail_without_retry(f"train: {status.get('error', '')}")
        if state == FAILED:
            raise TrainingFailed(f"train: {status.get('error', '')}")
        if state == "stale":
            self._stop(job, event["why"])
            raise TrainingFailed(f"train: stalled: {event['why']}")
        raise TrainingFailed(f"train: job {job['job_id']} ended {state}: {event.get('why') or status.get('error', '')}")

    def resume_execution(self, next_method: str, next_kwargs: dict[str, Any] | None, context: Context) -> Any:
        from airflow.sdk.exceptions import TaskDeferralTimeout

        try:
            return super().resume_execution(next_method, next_kwargs, context)
        except TaskDeferralTimeout:
            # A trigger timeout carries no event: the job comes from the store.
            store = context.get("task_state_store")
            job = self._job or (store.get(self.external_id_key) if store is not None else None)
            if job is not None:
                self._stop(job, f"the task's execution_timeout ({self.execution_timeout}) passed")
            raise fail_without_retry(f"train: the job ran past the task's execution_timeout "
                                     f"({self.execution_timeout}); it was stopped (emergency checkpoint "
                                     "first)") from None

    def on_kill(self) -> None:
        if self._job is not None:
            self._stop(self._job, "the task was killed")
