"""Scheduled (and on-demand) distributed MXNet training.

shard → validate (one mapped task per shard, then cross-shard checks) → check_reuse → provision
(setup) → train (dist_sync, checkpoints, retry = resume) → register, with teardown (runs on
success and failure) releasing the cluster. ``check_reuse`` is a branch: when an earlier
successful run registered a version from the same inputs (data manifest, the config fields that
decide the model, a custom network's code, the warm start), it goes to ``reuse`` instead, which
names that version and records the reuse in MLflow; provision, train, release and register show
as skipped, and its log says which run and version matched. The ``force`` Param trains anyway.
``train`` is ``plugins.train_operator.TrainJobOperator``: it starts the job's supervisor detached
on the cluster and defers while the job runs; every attempt loads the warm start ``check_reuse``
resolved (the run resolves it once).

This file reads like a config: Airflow's SDK and the project's light task module, nothing heavy,
no I/O at parse time. The schedule comes from ``MXPIPE_SCHEDULE`` (a cron expression; ``none``
turns scheduling off), read once at parse time from the settings (``common.settings``).

Every task that touches S3, MLflow or a cluster runs inside the run's Airflow connections
(``with_connections``: ``aws_default`` / ``mlflow_default``, or the ``aws_conn_id`` /
``mlflow_conn_id`` Params' connections; see ``plugins.connections``).

The shard task resolves the run's config once and pushes it as its ``config`` XCom; every later
task takes the config from there (see ``plugins.pipeline_tasks``). The tasks and their wiring are
``plugins.training_dag``; this file names the DAG and sets its limits from the settings.
"""
from __future__ import annotations

from common.settings import settings
from plugins.training_dag import training_dag

_SETTINGS = settings()
# MXPIPE_TRAIN_TIMEOUT_S and MXPIPE_DAGRUN_TIMEOUT_S (0: none), MXPIPE_TRAIN_DEFERRABLE: what each
# limit does is told at training_dag.
mxnet_training = training_dag("mxnet_training", train_timeout_s=_SETTINGS.train_timeout_s,
                              dagrun_timeout_s=_SETTINGS.dagrun_timeout_s,
                              deferrable=_SETTINGS.train_deferrable, doc_md=__doc__)
