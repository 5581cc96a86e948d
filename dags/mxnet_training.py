"""Scheduled (and on-demand) distributed MXNet training.

shard → validate (one mapped task per shard, then cross-shard checks) → provision (setup) →
train (dist_sync, checkpoints, retry = resume) → register, with teardown (runs on success and
failure) releasing the cluster.

This file reads like a config: Airflow's SDK and the project's light task module, nothing heavy,
no I/O at parse time. The schedule comes from ``MXPIPE_SCHEDULE`` (a cron expression; ``none``
turns scheduling off), read once at parse time from the environment.
"""
from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import CronTriggerTimetable, Param, dag, get_current_context, setup, task, teardown

from plugins import pipeline_tasks as tasks

SCHEDULE = os.environ.get("MXPIPE_SCHEDULE", "0 3 * * *")
RETRY_DELAY = timedelta(seconds=float(os.environ.get("MXPIPE_RETRY_DELAY_S", "30")))

PARAMS = {
    "dataset_uri": Param(os.environ.get("MXPIPE_DATASET_URI", "s3://mxpipe/datasets/digits/digits.csv"),
                         type="string", pattern=r"^(s3://|/).+(\.(csv|csv\.gz|parquet|pq)|/)$",
                         description="Source: a CSV/Parquet file, a glob of them, or a folder ending in '/' "
                                     "(its table files, or images + labels.csv); s3:// URI or absolute path."),
    "data_options": Param({}, type="object",
                          description="Further data.* settings as JSON, e.g. {\"id_column\": \"uid\", "
                                      "\"classes\": [0, 1], \"drift_action\": \"fail\"}."),
    "label_column": Param("label", type="string", minLength=1, description="Name of the label column."),
    "recipe": Param("digits", enum=["digits", "debug"], description="Named starting configuration."),
    "model": Param("mlp", enum=["mlp", "lenet", "resnet18", "resnet50"],
                   description="Network architecture (lenet and the ResNets need an image input_shape)."),
    "epochs": Param(20, type="integer", minimum=1, maximum=1000, description="Training epochs."),
    "batch_size": Param(32, type="integer", minimum=1, maximum=4096, description="Batch size per worker."),
    "learning_rate": Param(0.002, type="number", exclusiveMinimum=0, maximum=10, description="Learning rate."),
    "optimizer": Param("adam", enum=["adam", "sgd", "nag"], description="Optimizer (runs on the servers)."),
    "num_workers": Param(2, type="integer", minimum=1, maximum=16, description="MXNet workers."),
    "num_servers": Param(1, type="integer", minimum=1, maximum=8, description="Parameter servers."),
    "kvstore": Param("dist_sync", enum=["dist_sync", "dist_async"], description="Parameter-server mode."),
    "checkpoint_every_n_steps": Param(50, type="integer", minimum=1, maximum=1_000_000,
                                      description="Checkpoint to S3 every N steps (and at each epoch end)."),
    "registered_model_name": Param("digits-classifier", type="string", pattern=r"^[A-Za-z0-9_.-]{1,100}$",
                                   description="MLflow registered model to add a version to."),
    "backend": Param("local", enum=["local", "hosts", "ec2"],
                     description="Where the roles run: local processes, the hosts of MXPIPE_HOSTS_FILE "
                                 "(SSH), or EC2 instances (MXPIPE_EC2_FILE)."),
}


def _ids() -> tuple[str, str, int]:
    ctx = get_current_context()
    return ctx["dag"].dag_id, ctx["run_id"], ctx["ti"].try_number


@dag(
    dag_id="mxnet_training",
    schedule=None if SCHEDULE.lower() == "none" else CronTriggerTimetable(SCHEDULE, timezone="UTC"),
    catchup=False,
    max_active_runs=1,
    params=PARAMS,
    tags=["mxnet", "training"],
    default_args={"retries": 0},
    doc_md=__doc__,
)
def mxnet_training() -> None:
    @task
    def shard(params: dict | None = None) -> dict:
        dag_id, run_id, _ = _ids()
        return tasks.shard(params, dag_id, run_id)

    # Airflow maps only over a task's whole return value: this hands the shard list over.
    @task
    def shard_names(shards: dict) -> list:
        return shards["shard_names"]

    # One task per shard (named by the shard); a data failure fails it without a retry
    # (AirflowFailException); the one retry is for infrastructure errors.
    @task(map_index_template="{{ task.op_kwargs['shard_name'] }}", retries=1, retry_delay=timedelta(seconds=5))
    def validate_shard(shard_name: str, shards: dict, params: dict | None = None) -> dict:
        dag_id, run_id, _ = _ids()
        return tasks.validate_shard(params, shards, shard_name, dag_id, run_id)

    # Runs when the shards exist and every shard task is done, even failed ones: it writes the
    # whole report and fails with every failure listed; provision runs only if it succeeds.
    @task(trigger_rule="all_done_min_one_success")
    def validate(shards: dict, params: dict | None = None) -> dict:
        dag_id, run_id, _ = _ids()
        return tasks.validate(params, shards, dag_id, run_id)

    @setup
    def provision(params: dict | None = None) -> dict:
        dag_id, run_id, _ = _ids()
        return tasks.provision(params, dag_id, run_id)

    @task(retries=2, retry_delay=RETRY_DELAY, retry_exponential_backoff=True)
    def train(cluster: dict, shards: dict, params: dict | None = None) -> dict:
        dag_id, run_id, try_number = _ids()
        return tasks.train(params, cluster, shards, dag_id, run_id, try_number)

    @teardown
    def release(cluster: dict) -> dict:
        return tasks.teardown(cluster)

    @task(retries=2, retry_delay=RETRY_DELAY)
    def register(shards: dict, trained: dict, validation: dict, params: dict | None = None) -> dict:
        dag_id, run_id, try_number = _ids()
        return tasks.register(params, shards, trained, validation, dag_id, run_id, try_number)

    shards = shard()
    per_shard = validate_shard.partial(shards=shards).expand(shard_name=shard_names(shards))
    checked = validate(shards)
    per_shard >> checked
    cluster = provision()
    checked >> cluster
    trained = train(cluster, shards)
    trained >> release(cluster)
    register(shards, trained, checked)


mxnet_training()
