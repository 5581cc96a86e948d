"""The training DAG's definition, built from explicit arguments (``training_dag``).

``dags/mxnet_training.py`` builds the shipped DAG with the settings (``MXPIPE_TRAIN_TIMEOUT_S``,
``MXPIPE_DAGRUN_TIMEOUT_S``, ``MXPIPE_TRAIN_DEFERRABLE``); a deployment or a test stack can build
more DAGs of the same pipeline under other ids with other limits, side by side on one Airflow
(each run's S3 partition, cluster and MLflow tags are keyed by its own DAG id). The schedule,
``max_active_runs``, retry delay and the train task's poll interval (``MXPIPE_TRAIN_POLL_S``) come
from the settings for every DAG built here.

After validation, ``check_reuse`` (a branch) either skips to ``reuse``, when an earlier successful
run registered a version from the same training inputs and the ``force`` Param is off (nothing
is provisioned, trained or registered, and no model or review event is emitted), or goes on to
``provision``, ``train``, ``release`` and ``register``.

Parse-time light like a DAG file: Airflow's SDK and the project's light task module only.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import (DAG, AssetAlias, AssetOrTimeSchedule, CronTriggerTimetable, dag, get_current_context,
                         setup, task, teardown)

from common.settings import settings
from plugins import callbacks, pipeline_tasks
from plugins.assets import MODEL, SHARDS, SOURCE_DATASET
from plugins.connections import with_connections
from plugins.params import training_params
from plugins.review_tasks import model_asset
from plugins.train_operator import TrainJobOperator

# The model name is a run-time Param, so the "new version of <name>" Asset the review DAG waits
# on is emitted through an alias (Airflow creates the Asset if no DAG declared it yet).
REGISTERED_MODEL = AssetAlias(name="mxpipe.registered_model")
# The two paths after validation (check_reuse's branch): train a model, or reuse an earlier one.
PROVISION_TASK, REUSE_TASK = "provision", "reuse"


def _schedule(cron: str) -> AssetOrTimeSchedule | None:
    """The cron, or an update of the source dataset Asset, whichever comes first."""
    if cron.lower() == "none":
        return None
    # A new deployment waits for the next cron time. run_immediately=False does not say that in
    # Airflow 3.3: it is read like None, which runs the most recent past time at once when it is
    # less than a tenth of the period ago (2.4 h for a daily run); a zero buffer never does.
    # Seen: a first `make demo` at 05:07 raced a scheduled 03:00 run of the same inputs.
    first = timedelta(0)
    return AssetOrTimeSchedule(timetable=CronTriggerTimetable(cron, timezone="UTC", run_immediately=first),
                               assets=[SOURCE_DATASET])


def _emit(asset: object, extra: dict) -> None:
    """Attach this run's concrete location to the asset event (the URI names the collection)."""
    get_current_context()["outlet_events"][asset].extra = extra


def _ids() -> tuple[str, str, int]:
    ctx = get_current_context()
    return ctx["dag"].dag_id, ctx["run_id"], ctx["ti"].try_number


def _limit(seconds: float) -> timedelta | None:
    return timedelta(seconds=seconds) if seconds else None


def training_dag(dag_id: str, *, train_timeout_s: float, dagrun_timeout_s: float, deferrable: bool,
                 doc_md: str | None = None) -> DAG:
    """The pipeline as a DAG named ``dag_id``.

    ``train_timeout_s``: the train task's limit, counted from its job's start (0: none); the job's
    own limit is the cluster.job_timeout_s Param, and a hung job is caught by stall detection.
    ``dagrun_timeout_s``: a whole run's limit (0: none); the deferred train task's trigger is
    cancelled when the run times out, and its on_kill stops the job. ``deferrable``: the train
    task defers while its job trains, or polls it in its own process (no triggerer needed).
    """
    if train_timeout_s < 0 or dagrun_timeout_s < 0:
        raise ValueError(f"{dag_id}: a timeout must be >= 0 (0: none), got train_timeout_s={train_timeout_s}, "
                         f"dagrun_timeout_s={dagrun_timeout_s}")
    current = settings()
    retry_delay = timedelta(seconds=current.retry_delay_s)

    @dag(
        dag_id=dag_id,
        schedule=_schedule(current.schedule),
        catchup=False,
        # One active run unless configured: runs of one DAG share the dataset's shard cache.
        max_active_runs=current.max_active_runs,
        dagrun_timeout=_limit(dagrun_timeout_s),
        params=training_params(),
        tags=["mxnet", "training"],
        # A one-line summary (dag, task, attempt, why) of every failed or retried attempt.
        default_args={"retries": 0, "on_failure_callback": callbacks.on_failure,
                      "on_retry_callback": callbacks.on_retry},
        doc_md=doc_md,
    )
    def mxnet_training() -> None:
        shards, config, checked = checked_shards()
        _train_and_register(shards, config, checked, retry_delay=retry_delay, train_timeout_s=train_timeout_s,
                            deferrable=deferrable, poll_s=current.train_poll_s)

    return mxnet_training()


# The data step's tasks retry once, for infrastructure errors only (a lost Celery worker host,
# a storage hiccup): each rewrites the same content-addressed files or finds its own committed
# result, and a data failure fails without a retry (AirflowFailException) whatever this says.
DATA_RETRY = {"retries": 1, "retry_delay": timedelta(seconds=5)}


def _part_task(step: str) -> Any:
    """The mapped task of one sharding step per part of the source (``shard_count`` or
    ``shard_part``: ``pipeline_tasks``' function of that name). A data failure fails without a
    retry; the one retry is for infrastructure errors (a part rewrites the same files; the merge
    finds its own committed manifest)."""
    run_step = getattr(pipeline_tasks, step)

    @task(task_id=step, map_index_template="part {{ task.op_kwargs['part'] }}", **DATA_RETRY)
    @with_connections
    def part_task(part: int, planned: dict, config: dict) -> str:
        return run_step(config, planned, part)

    return part_task


def checked_shards(sweep_cap: int | None = None) -> tuple[Any, Any, Any]:
    """Inside the DAG: shard the source (planned, then counted and sharded part by part in mapped
    tasks, then merged), validate every shard, then the whole set; the shards, the run's config
    (the shard task's XCom) and the validation's result. ``sweep_cap``: the run is a sweep of at
    most that many trials at once, checked by the first task before anything is sharded."""
    @task(**DATA_RETRY)
    @with_connections
    def shard(params: dict | None = None) -> dict:
        dag_id, run_id, _ = _ids()
        config, planned = pipeline_tasks.shard(params, dag_id, run_id, sweep_cap=sweep_cap)
        get_current_context()["ti"].xcom_push(key=pipeline_tasks.CONFIG_XCOM_KEY, value=config)
        return planned

    # Airflow maps only over a task's whole return value: this hands the part indices over (an
    # empty list, when the shards are reused or the source is an image folder, skips the parts).
    @task(**DATA_RETRY)
    def shard_parts(planned: dict) -> list:
        return planned["parts"]

    # One task per part of the source, twice: its counts, then its pieces of every shard (each
    # part needs every part's counts to know where it starts). Intermediate files go to the store.
    shard_count, shard_part = _part_task("shard_count"), _part_task("shard_part")

    # none_failed: it also runs when the parts were skipped (reused shards, an image folder).
    @task(outlets=[SHARDS], trigger_rule="none_failed", **DATA_RETRY)
    @with_connections
    def shard_merge(planned: dict, config: dict) -> dict:
        dag_id, run_id, _ = _ids()
        out = pipeline_tasks.shard_merge(config, planned, dag_id, run_id)
        _emit(SHARDS, {"shards_prefix": out["shards_prefix"], "manifest_digest": out["manifest_digest"]})
        return out

    # Airflow maps only over a task's whole return value: this hands the shard list over.
    @task(**DATA_RETRY)
    def shard_names(shards: dict) -> list:
        return shards["shard_names"]

    # One task per shard (named by the shard); a data failure fails it without a retry
    # (AirflowFailException); the one retry is for infrastructure errors.
    @task(map_index_template="{{ task.op_kwargs['shard_name'] }}", **DATA_RETRY)
    @with_connections
    def validate_shard(shard_name: str, shards: dict, config: dict) -> dict:
        dag_id, run_id, _ = _ids()
        return pipeline_tasks.validate_shard(config, shards, shard_name, dag_id, run_id)

    # Runs when the shards exist and every shard task is done, even failed ones: it writes the
    # whole report and fails with every failure listed; provision runs only if it succeeds.
    @task(trigger_rule="all_done_min_one_success", **DATA_RETRY)
    @with_connections
    def validate(shards: dict, config: dict) -> dict:
        dag_id, run_id, _ = _ids()
        return pipeline_tasks.validate(config, shards, dag_id, run_id)

    planned = shard()
    config = planned[pipeline_tasks.CONFIG_XCOM_KEY]
    indices = shard_parts(planned)
    counted = shard_count.partial(planned=planned, config=config).expand(part=indices)
    parted = shard_part.partial(planned=planned, config=config).expand(part=indices)
    counted >> parted
    shards = shard_merge(planned, config)
    parted >> shards
    per_shard = validate_shard.partial(shards=shards, config=config).expand(shard_name=shard_names(shards))
    checked = validate(shards, config)
    per_shard >> checked
    return shards, config, checked


def register_task(retry_delay: timedelta) -> Any:
    """The register task (the training DAG's, and the sweep DAG's for its best trial): score the
    trained model on the test split, log its MLflow run, register a version with its model card
    (the review DAG, triggered by the new version, runs the gate). ``trial_run_id``: a sweep
    trial's run key, whose storage and MLflow run the model is in; empty: the DAG run's."""
    @task(task_id="register", retries=2, retry_delay=retry_delay, outlets=[MODEL, REGISTERED_MODEL])
    @with_connections
    def register(shards: dict, trained: dict, validation: dict, config: dict, inputs: dict, trial_run_id: str = "",
                 params: dict | None = None) -> dict:
        dag_id, run_id, try_number = _ids()
        # The task's own page (Airflow's ti.log_url) less its task part: the DAG run's page.
        run_page = get_current_context()["ti"].log_url.split("/tasks/", 1)[0]
        out = pipeline_tasks.register(config, params, shards, trained, validation, inputs, dag_id,
                                      trial_run_id or run_id, try_number, airflow_run_url=run_page)
        _emit(MODEL, {"name": out["registered_model_name"], "version": str(out["version"]),
                      "run_url": out["run_url"]})
        # What model_review reads (plugins.review_tasks._from_events): which version to review.
        get_current_context()["outlet_events"][REGISTERED_MODEL].add(
            model_asset(out["registered_model_name"]),
            extra={"registered_model_name": out["registered_model_name"], "version": str(out["version"])})
        return out

    return register


def _train_and_register(shards: Any, config: Any, checked: Any, *, retry_delay: timedelta, train_timeout_s: float,
                        deferrable: bool, poll_s: float) -> None:
    """Inside the DAG: once validation passed, either reuse the version an earlier run trained on
    the same inputs, or provision the cluster, train on it, always release it, and register the
    trained model."""
    # A branch, not a short-circuit: one of two paths runs. Reuse skips provision (the setup:
    # its teardown release is skipped with it, Airflow's all_done_setup_success rule) and
    # register; train is skipped as its upstream was. Training skips reuse.
    @task.branch(retries=2, retry_delay=retry_delay)
    @with_connections
    def check_reuse(shards: dict, config: dict, params: dict | None = None) -> str:
        dag_id, run_id, _ = _ids()
        decision = pipeline_tasks.check_reuse(config, params, shards, dag_id, run_id)
        ti = get_current_context()["ti"]
        ti.xcom_push(key=pipeline_tasks.INPUTS_XCOM_KEY, value=decision["inputs"])
        ti.xcom_push(key=pipeline_tasks.REUSABLE_XCOM_KEY, value=decision["reusable"])
        ti.xcom_push(key=pipeline_tasks.WARM_START_XCOM_KEY, value=decision["warm_start"])
        return REUSE_TASK if decision["reusable"] else PROVISION_TASK

    @setup
    @with_connections
    def provision(config: dict, params: dict | None = None) -> dict:
        dag_id, run_id, _ = _ids()
        return pipeline_tasks.provision(config, params, dag_id, run_id)

    @teardown
    @with_connections
    def release(cluster: dict) -> dict:
        return pipeline_tasks.teardown(cluster)

    register = register_task(retry_delay)

    # No outlets: a reuse registers no version, so it emits no MODEL event and no review trigger
    # (Airflow emits a declared Asset outlet on every success; the version was reviewed when its
    # own run registered it). Its return value is what register's would be, naming the version.
    @task(task_id=REUSE_TASK, retries=2, retry_delay=retry_delay)
    @with_connections
    def reuse(inputs: dict, reusable: dict) -> dict:
        dag_id, run_id, _ = _ids()
        return pipeline_tasks.reuse(inputs, reusable, dag_id, run_id)

    decision = check_reuse(shards, config)
    checked >> decision
    inputs = decision[pipeline_tasks.INPUTS_XCOM_KEY]
    cluster = provision(config)
    decision >> cluster
    # The warm start the reuse decision was made on, for every attempt (resolved once per run).
    trained = TrainJobOperator(task_id="train", cluster=cluster, shards=shards, config=config,
                               warm_start=decision[pipeline_tasks.WARM_START_XCOM_KEY], retries=2,
                               retry_delay=retry_delay, retry_exponential_backoff=True,
                               execution_timeout=_limit(train_timeout_s), deferrable=deferrable,
                               poll_s=poll_s).output
    trained >> release(cluster)
    register(shards, trained, checked, config, inputs)
    reuse(inputs, decision[pipeline_tasks.REUSABLE_XCOM_KEY])
