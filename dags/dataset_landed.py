"""Announce that new source data has landed: emits the source dataset Asset, which triggers a
retraining run of ``mxnet_training`` (its schedule is the cron OR this Asset).

Triggered by hand or through the API by whatever writes the data (an upload job, an S3 event
forwarder). An upstream Airflow DAG that writes the data need not call this one: it declares
``outlets=[SOURCE_DATASET]`` (``plugins.assets``; match by that object, as its URI is an
``x-mxpipe://`` name, not the s3:// URI) on its writing task instead.
"""
from __future__ import annotations

from airflow.sdk import dag, task

from common.settings import settings
from plugins.assets import SOURCE_DATASET, check_landed
from plugins.connections import with_connections


@dag(
    dag_id="dataset_landed",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    tags=["mxnet", "dataset"],
    default_args={"retries": 0},
    doc_md=__doc__,
)
def dataset_landed() -> None:
    # The event is emitted only if the task succeeds: no data, no retraining run.
    @task(outlets=[SOURCE_DATASET])
    @with_connections  # the source is read with the S3 connection, like the training DAG's tasks
    def announce() -> dict:
        return check_landed(settings().dataset_uri)

    announce()


dataset_landed()
