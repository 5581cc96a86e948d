"""Reap clusters that outlived their TTL: the safety net behind every run's teardown task.

Every cluster carries its run id and an expiry time (a record in S3 for every backend, which
this DAG reads on whichever Celery worker it runs, and tags on EC2 instances). A teardown task that never ran (a scheduler crash, a deleted DAG run)
leaves such a cluster behind; this DAG terminates it once its TTL has passed.
``MXPIPE_REAPER_SCHEDULE`` sets the cron schedule (default every 15 minutes, UTC; ``none``
turns it off). The EC2 side uses the ``aws_default`` connection and the ``mxpipe_ec2`` Variable
(else the environment and ``MXPIPE_EC2_FILE``).
"""
from __future__ import annotations

from datetime import timedelta

from airflow.sdk import CronTriggerTimetable, dag, task

from common.settings import settings
from plugins import pipeline_tasks
from plugins.connections import with_connections

SCHEDULE = settings().reaper_schedule


@dag(
    dag_id="cluster_reaper",
    schedule=None if SCHEDULE.lower() == "none" else CronTriggerTimetable(SCHEDULE, timezone="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["mxnet", "cost"],
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    doc_md=__doc__,
)
def cluster_reaper() -> None:
    @task(execution_timeout=timedelta(minutes=10))
    @with_connections
    def reap() -> dict:
        return pipeline_tasks.reap()

    reap()


cluster_reaper()
