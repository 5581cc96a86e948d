"""The sweep DAG's definition (``sweep_dag``), built from the training DAG's task factories.

shard → validate (``plugins.training_dag.checked_shards``, the training DAG's own tasks; the
first task also plans the sweep's trials and refuses a bad sweep before anything is sharded) →
``plan_trials`` (which also resolves the sweep's warm start, once: every trial and retry loads
that checkpoint) → one mapped task group per trial: ``gate`` (``plugins.sweep_gate``: waits,
deferred, until the trial may take a cluster) → ``provision`` (setup) → ``train`` (the training
DAG's ``TrainJobOperator``, on the trial's own cluster, under the trial's run key) → ``release``
(teardown, on success and failure) → ``select_best`` (trigger rule ``all_done``: a failed trial
does not stop the sweep; it needs one finished trial) → ``register`` (the training DAG's
register task: test split, MLflow run, version, model card; the review DAG runs the gate).

Concurrency: at most the run's ``sweep.parallel`` trials hold a cluster at once (provisioned and
not yet released): the gates admit the trials in plan order, trial ``i`` once fewer than
``sweep.parallel`` of the trials before it are not yet released (``common.sweep.may_take_cluster``).
The deployment's cap ``parallel`` (``MXPIPE_SWEEP_PARALLEL``, fixed when the file is parsed) is
the refusal bound of ``sweep.parallel`` and, as a backstop, the ``max_active_tis_per_dagrun`` of
``provision`` and ``train`` (Airflow 3.3 counts a deferred train task against it); the gates have
no such limit, so a waiting gate never takes a slot a running trial needs.

Parse-time light like a DAG file: Airflow's SDK and the project's light task modules only.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import DAG, dag, get_current_context, setup, task, task_group, teardown

from common.settings import settings
from plugins import callbacks, pipeline_tasks, sweep_tasks
from plugins.connections import with_connections
from plugins.params import sweep_params
from plugins.sweep_gate import TrialGateSensor
from plugins.train_operator import TrainJobOperator
from plugins.training_dag import _ids, _limit, checked_shards, register_task

# A trial's rendered map index: "trial 2: optim.learning_rate=0.01".
TRIAL_LABEL = "{{ task.op_kwargs['trial']['label'] }}"


def sweep_dag(dag_id: str, *, parallel: int, train_timeout_s: float, dagrun_timeout_s: float, deferrable: bool,
              doc_md: str | None = None) -> DAG:
    """The sweep as a DAG named ``dag_id``; ``parallel``: the deployment's cap on trials holding a
    cluster at once (a sweep asking for more is refused by its first task; a run's own
    ``sweep.parallel`` below it is kept by the trials' gates). The limits are the training DAG's
    (``plugins.training_dag.training_dag``), the train timeout per trial; the dagrun timeout
    also bounds each trial's wait at its gate."""
    if parallel < 1:
        raise ValueError(f"{dag_id}: parallel must be >= 1, got {parallel}")
    current = settings()
    retry_delay = timedelta(seconds=current.retry_delay_s)

    @dag(dag_id=dag_id, schedule=None, catchup=False, max_active_runs=current.max_active_runs,
         dagrun_timeout=_limit(dagrun_timeout_s), params=sweep_params(), tags=["mxnet", "sweep"],
         default_args={"retries": 0, "on_failure_callback": callbacks.on_failure,
                       "on_retry_callback": callbacks.on_retry},
         doc_md=doc_md)
    def mxnet_sweep() -> None:
        shards, config, checked = checked_shards(sweep_cap=parallel)

        @task(retries=2, retry_delay=retry_delay)
        @with_connections
        def plan_trials(config: dict, params: dict | None = None) -> list:
            dag_id, run_id, _ = _ids()
            return sweep_tasks.plan_trials(config, params, dag_id, run_id, parallel)

        trials = plan_trials(config)
        checked >> trials
        trained = _trial_group(shards, parallel=parallel, retry_delay=retry_delay, train_timeout_s=train_timeout_s,
                               deferrable=deferrable, poll_s=current.train_poll_s,
                               gate_timeout_s=dagrun_timeout_s).expand(trial=trials)

        # all_done: it runs whatever the trials' ends; a trial that failed is left out of the choice.
        @task(trigger_rule="all_done", retries=2, retry_delay=retry_delay)
        @with_connections
        def select_best(trials: list, shards: dict) -> dict:
            dag_id, run_id, _ = _ids()
            best = sweep_tasks.select_best(trials, shards, dag_id, run_id)
            ti = get_current_context()["ti"]
            for key in sweep_tasks.BEST_XCOM_KEYS:
                ti.xcom_push(key=key, value=best[key])
            return best

        best = select_best(trials, shards)
        trained >> best
        register_task(retry_delay)(shards, best["trained"], checked, best["config"], best["inputs"],
                                   best["trial_run_id"])

    return mxnet_sweep()


def _trial_group(shards: Any, *, parallel: int, retry_delay: timedelta, train_timeout_s: float, deferrable: bool,
                 poll_s: float, gate_timeout_s: float) -> Any:
    """One trial (a mapped task group, expanded over the planned trials): its turn at the gate,
    its own cluster provisioned, the training job on it (retries resume from the trial's
    checkpoints), the cluster released whatever happened."""
    @task_group(group_id="trial")
    def trial_group(trial: dict) -> Any:
        # No max_active_tis_per_dagrun here: a waiting gate must not take a slot of the cap.
        # Its timeout: the run's own limit, else Airflow's [sensors] default_timeout (None); a
        # timeout fails it for good (AirflowSensorTimeout), the retries are for a passing API error.
        gate = TrialGateSensor(task_id="gate", trial=trial, cap=parallel, deferrable=deferrable, poll_s=poll_s,
                               timeout=gate_timeout_s or None, retries=2, retry_delay=retry_delay,
                               map_index_template="{{ task.trial['label'] }}")

        @setup
        @task(map_index_template=TRIAL_LABEL, max_active_tis_per_dagrun=parallel)
        @with_connections
        def provision(trial: dict, params: dict | None = None) -> dict:
            dag_id, _, _ = _ids()
            return pipeline_tasks.provision(trial["config"], params, dag_id, trial["run_id"])

        @teardown
        @with_connections
        def release(cluster: dict) -> dict:
            return pipeline_tasks.teardown(cluster)

        cluster = provision(trial=trial)  # a keyword: the map index template reads op_kwargs
        gate >> cluster
        trained = TrainJobOperator(task_id="train", cluster=cluster, shards=shards, trial=trial, retries=2,
                                   retry_delay=retry_delay, retry_exponential_backoff=True,
                                   execution_timeout=_limit(train_timeout_s), deferrable=deferrable, poll_s=poll_s,
                                   max_active_tis_per_dagrun=parallel,
                                   map_index_template="{{ task.trial['label'] }}").output
        trained >> release(cluster)
        return trained

    return trial_group
