"""The sweep trial's gate: the first task of a trial, it holds the trial until it may take a cluster.

Why a gate task: Airflow's concurrency limits (``max_active_tis_per_dagrun``) are fixed when the
DAG is parsed, and Airflow 3.3 has no per-run limit a Param or the run's config could set; a
run's ``sweep.parallel`` is only known once its config is resolved. So ``TrialGateSensor``
admits the trials in plan order by ``common.sweep.may_take_cluster``: trial ``i`` passes once
fewer than ``parallel`` of the trials planned before it are still open, a trial counting as open
until its ``trial.release`` (the teardown) has ended, in any final state (success, failed,
skipped, upstream_failed, removed: a trial that failed never blocks the sweep).

It reads the release tasks' states of its own DAG run through the Task SDK
(``RuntimeTaskInstance.get_task_states``, the call Airflow's ``ExternalTaskSensor`` and its
``WorkflowTrigger`` make), so it needs no database access of its own. With ``deferrable`` (a
deployment with a triggerer, ``MXPIPE_TRAIN_DEFERRABLE``) a trial that must wait defers to
``TrialGateTrigger``, which polls in the triggerer and ends the task itself
(``TaskSuccessEvent``: no worker is started again to finish it); without one, the sensor runs in
``reschedule`` mode. Either way a waiting gate holds no worker slot, no pool slot and no slot of
the ``provision``/``train`` tasks' ``max_active_tis_per_dagrun`` (the gate has none), so it never
keeps the trial it waits for from running.

The wait is bounded by the sensor's ``timeout`` (the sweep's ``dagrun_timeout``, else Airflow's
``[sensors] default_timeout``); past it the gate fails, the trial's tasks are ``upstream_failed``
and the sweep goes on without it. The gate also checks that its map index is its trial's index
(the order ``plan_trials`` returned), which the admission order relies on.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator
from airflow.triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent

from plugins.failures import fail_without_retry

if TYPE_CHECKING:
    from airflow.sdk import Context

# The task whose end frees a trial's cluster (the trial group's teardown).
RELEASE_TASK = "trial.release"
# The final task instance states: a release in any of them holds no cluster any more.
ENDED_STATES = frozenset({"success", "failed", "skipped", "upstream_failed", "removed"})
# Without a triggerer each poke is a task process started by the scheduler: seconds of CPU, so
# far rarer than the trigger's reads (one small API call each).
RESCHEDULE_POKE_S = 30.0


def ended_trials(task_states: Mapping[str, Mapping[str, Any]], run_id: str, task_id: str = RELEASE_TASK) -> set[int]:
    """The map indexes whose ``task_id`` instance has ended, from ``get_task_states``' answer
    (``{run_id: {"<task_id>_<map index>": state}}``; an instance not yet expanded is keyed
    ``<task_id>`` alone and ends nothing)."""
    ended = set()
    for key, state in task_states.get(run_id, {}).items():
        name, _, index = key.rpartition("_")
        if name == task_id and index.isdigit() and state in ENDED_STATES:
            ended.add(int(index))
    return ended


def _decide(run_id: str, index: int, parallel: int, task_states: Mapping[str, Any]) -> tuple[bool, list[int]]:
    """Whether trial ``index`` may take a cluster, and the earlier trials still open."""
    # Here, not at the top: common.sweep loads the config models, and the DAG file imports this.
    from common.sweep import may_take_cluster, open_before

    ended = ended_trials(task_states, run_id)
    return may_take_cluster(index, parallel, ended), open_before(index, ended)


class TrialGateTrigger(BaseTrigger):
    """Polls the run's release states every ``poll_s`` in the triggerer; ends the gate task with
    success when its trial may take a cluster (the deferral's timeout bounds the wait)."""

    def __init__(self, *, dag_id: str, run_id: str, index: int, parallel: int, poll_s: float) -> None:
        super().__init__()
        self.dag_id, self.run_id, self.index, self.parallel, self.poll_s = dag_id, run_id, index, parallel, poll_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"dag_id": self.dag_id, "run_id": self.run_id, "index": self.index, "parallel": self.parallel,
                 "poll_s": self.poll_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # sync_to_async (one thread, as WorkflowTrigger does): the SDK's call goes through the
        # triggerer's channel to its supervisor, which is not made for concurrent senders.
        from asgiref.sync import sync_to_async
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        waiting: list[int] | None = None
        while True:
            try:
                states = await sync_to_async(RuntimeTaskInstance.get_task_states)(
                    dag_id=self.dag_id, task_ids=[RELEASE_TASK], run_ids=[self.run_id])
            except Exception as exc:  # noqa: BLE001 - an API hiccup is no answer: read again (the timeout bounds it)
                self.log.warning("could not read the trials' release states: %s", exc)
            else:
                admitted, still_open = _decide(self.run_id, self.index, self.parallel, states)
                if admitted:
                    self.log.info("trial %d may take a cluster (open before it: %s, parallel %d)", self.index,
                                  still_open, self.parallel)
                    yield TaskSuccessEvent()
                    return
                if still_open != waiting:  # one line per change, not per poll
                    waiting = still_open
                    self.log.info("trial %d waits: trials %s still hold or may take a cluster (parallel %d)",
                                  self.index, still_open, self.parallel)
            await asyncio.sleep(self.poll_s)


class TrialGateSensor(BaseSensorOperator):
    """Holds one trial until it may take a cluster (``common.sweep.may_take_cluster``): deferred
    to ``TrialGateTrigger``, or in ``reschedule`` mode without a triggerer."""

    template_fields = ("trial",)

    def __init__(self, *, trial: Any, cap: int, deferrable: bool = True, poll_s: float = 2.0, **kwargs: Any) -> None:
        kwargs.setdefault("mode", "reschedule")
        kwargs.setdefault("poke_interval", RESCHEDULE_POKE_S)
        super().__init__(**kwargs)
        self.trial = trial
        self.cap = cap
        self.deferrable = deferrable
        self.poll_s = poll_s

    def _ids(self, context: Context) -> tuple[str, str, int, int]:
        ti = context["ti"]
        # A trial planned by an older plan_trials (a run going on across a deployment) has no
        # "parallel": the deployment's cap, the bound it was planned under.
        index, parallel = int(self.trial["index"]), int(self.trial.get("parallel", self.cap))
        if ti.map_index != index:
            # The admission order is the plan's: a trial mapped elsewhere would wait on the wrong ones.
            raise fail_without_retry(f"trial gate: map index {ti.map_index} is not the trial's index {index}: the "
                                     "mapped trials are not in plan order")
        return ti.dag_id, ti.run_id, index, parallel

    def poke(self, context: Context) -> bool:
        dag_id, run_id, index, parallel = self._ids(context)
        states = context["ti"].get_task_states(dag_id=dag_id, task_ids=[RELEASE_TASK], run_ids=[run_id])
        admitted, still_open = _decide(run_id, index, parallel, states)
        self.log.info("trial %d %s: open before it %s, parallel %d", index,
                      "may take a cluster" if admitted else "waits", still_open, parallel)
        return admitted

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)  # reschedule mode: a poke per start, bounded by timeout
        if self.poke(context):
            return None  # the first ``parallel`` trials, and any admitted at once: no deferral
        dag_id, run_id, index, parallel = self._ids(context)
        self.defer(trigger=TrialGateTrigger(dag_id=dag_id, run_id=run_id, index=index, parallel=parallel,
                                            poll_s=self.poll_s),
                   method_name="execute_complete", timeout=timedelta(seconds=self.timeout))

    def execute_complete(self, context: Context, event: Any = None) -> None:
        """Not reached by the trigger's own end (``TaskSuccessEvent``); kept for a plain event."""
        return None
