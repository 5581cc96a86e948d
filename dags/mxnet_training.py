"""Scheduled (and on-demand) distributed MXNet training.

shard → validate (one mapped task per shard, then cross-shard checks) → provision (setup) →
train (dist_sync, checkpoints, retry = resume) → register, with teardown (runs on success and
failure) releasing the cluster. ``train`` is ``plugins.train_operator.TrainJobOperator``: it
starts the job's supervisor detached on the cluster and defers while the job runs.

This file reads like a config: Airflow's SDK and the project's light task module, nothing heavy,
no I/O at parse time. The schedule comes from ``MXPIPE_SCHEDULE`` (a cron expression; ``none``
turns scheduling off), read once at parse time from the settings (``common.settings``).

Every task that touches S3, MLflow or a cluster runs inside the run's Airflow connections
(``with_connections``: ``aws_default`` / ``mlflow_default``, or the ``aws_conn_id`` /
``mlflow_conn_id`` Params' connections; see ``plugins.connections``).

The shard task resolves the run's config once and pushes it as its ``config`` XCom; every later
task takes the config from there (see ``plugins.pipeline_tasks``).
"""
from __future__ import annotations

from datetime import timedelta

from airflow.sdk import (AssetAlias, AssetOrTimeSchedule, CronTriggerTimetable, dag, get_current_context, setup,
                         task, teardown)

from common.settings import settings
from plugins import callbacks
from plugins.assets import MODEL, SHARDS, SOURCE_DATASET
from plugins.connections import with_connections
from plugins import pipeline_tasks as tasks
from plugins.params import training_params
from plugins.review import model_asset
from plugins.train_operator import TrainJobOperator

_SETTINGS = settings()
SCHEDULE = _SETTINGS.schedule
# One active run unless configured: runs of one DAG share the dataset's shard cache.
MAX_ACTIVE_RUNS = _SETTINGS.max_active_runs
RETRY_DELAY = timedelta(seconds=_SETTINGS.retry_delay_s)
# The train task's limit, counted from its job's start (MXPIPE_TRAIN_TIMEOUT_S; 0: none). The job's
# own limit is the cluster.job_timeout_s Param; a hung job is caught by stall detection.
TRAIN_TIMEOUT = timedelta(seconds=_SETTINGS.train_timeout_s) if _SETTINGS.train_timeout_s else None
# A whole run's limit (MXPIPE_DAGRUN_TIMEOUT_S; 0: none): the deferred train task's trigger is
# cancelled when the run times out, and its on_kill stops the job.
DAGRUN_TIMEOUT = timedelta(seconds=_SETTINGS.dagrun_timeout_s) if _SETTINGS.dagrun_timeout_s else None

PARAMS = training_params()
# The model name is a run-time Param, so the "new version of <name>" Asset the review DAG waits
# on is emitted through an alias (Airflow creates the Asset if no DAG declared it yet).
REGISTERED_MODEL = AssetAlias(name="mxpipe.registered_model")


def _schedule() -> AssetOrTimeSchedule | None:
    """The cron, or an update of the source dataset Asset, whichever comes first."""
    if SCHEDULE.lower() == "none":
        return None
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(SCHEDULE, timezone="UTC"), assets=[SOURCE_DATASET])


def _emit(asset: object, extra: dict) -> None:
    """Attach this run's concrete location to the asset event (the URI names the collection)."""
    get_current_context()["outlet_events"][asset].extra = extra


def _ids() -> tuple[str, str, int]:
    ctx = get_current_context()
    return ctx["dag"].dag_id, ctx["run_id"], ctx["ti"].try_number


@dag(
    dag_id="mxnet_training",
    schedule=_schedule(),
    catchup=False,
    max_active_runs=MAX_ACTIVE_RUNS,
    dagrun_timeout=DAGRUN_TIMEOUT,
    params=PARAMS,
    tags=["mxnet", "training"],
    # A one-line summary (dag, task, attempt, why) of every failed or retried attempt.
    default_args={"retries": 0, "on_failure_callback": callbacks.on_failure,
                  "on_retry_callback": callbacks.on_retry},
    doc_md=__doc__,
)
def mxnet_training() -> None:
    @task(outlets=[SHARDS])
    @with_connections
    def shard(params: dict | None = None) -> dict:
        dag_id, run_id, _ = _ids()
        config, out = tasks.shard(params, dag_id, run_id)
        get_current_context()["ti"].xcom_push(key=tasks.CONFIG_XCOM_KEY, value=config)
        _emit(SHARDS, {"shards_prefix": out["shards_prefix"], "manifest_digest": out["manifest_digest"]})
        return out

    # Airflow maps only over a task's whole return value: this hands the shard list over.
    @task
    def shard_names(shards: dict) -> list:
        return shards["shard_names"]

    # One task per shard (named by the shard); a data failure fails it without a retry
    # (AirflowFailException); the one retry is for infrastructure errors.
    @task(map_index_template="{{ task.op_kwargs['shard_name'] }}", retries=1, retry_delay=timedelta(seconds=5))
    @with_connections
    def validate_shard(shard_name: str, shards: dict, config: dict) -> dict:
        dag_id, run_id, _ = _ids()
        return tasks.validate_shard(config, shards, shard_name, dag_id, run_id)

    # Runs when the shards exist and every shard task is done, even failed ones: it writes the
    # whole report and fails with every failure listed; provision runs only if it succeeds.
    @task(trigger_rule="all_done_min_one_success")
    @with_connections
    def validate(shards: dict, config: dict) -> dict:
        dag_id, run_id, _ = _ids()
        return tasks.validate(config, shards, dag_id, run_id)

    @setup
    @with_connections
    def provision(config: dict, params: dict | None = None) -> dict:
        dag_id, run_id, _ = _ids()
        return tasks.provision(config, params, dag_id, run_id)

    @teardown
    @with_connections
    def release(cluster: dict) -> dict:
        return tasks.teardown(cluster)

    @task(retries=2, retry_delay=RETRY_DELAY, outlets=[MODEL, REGISTERED_MODEL])
    @with_connections
    def register(shards: dict, trained: dict, validation: dict, config: dict, params: dict | None = None) -> dict:
        dag_id, run_id, try_number = _ids()
        out = tasks.register(config, params, shards, trained, validation, dag_id, run_id, try_number)
        _emit(MODEL, {"name": out["registered_model_name"], "version": str(out["version"]),
                      "run_url": out["run_url"]})
        # What model_review reads (plugins.review._from_events): which version to review.
        get_current_context()["outlet_events"][REGISTERED_MODEL].add(
            model_asset(out["registered_model_name"]),
            extra={"registered_model_name": out["registered_model_name"], "version": str(out["version"])})
        return out

    shards = shard()
    config = shards[tasks.CONFIG_XCOM_KEY]
    per_shard = validate_shard.partial(shards=shards, config=config).expand(shard_name=shard_names(shards))
    checked = validate(shards, config)
    per_shard >> checked
    cluster = provision(config)
    checked >> cluster
    trained = TrainJobOperator(task_id="train", cluster=cluster, shards=shards, config=config, retries=2,
                               retry_delay=RETRY_DELAY, retry_exponential_backoff=True,
                               execution_timeout=TRAIN_TIMEOUT, deferrable=_SETTINGS.train_deferrable,
                               poll_s=_SETTINGS.train_poll_s).output
    trained >> release(cluster)
    register(shards, trained, checked, config)


mxnet_training()
