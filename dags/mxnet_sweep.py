"""Hyperparameter sweeps of the distributed MXNet training (docs/sweeps.md).

shard → validate → plan_trials → per trial (a mapped task group): gate (the trial's turn) →
provision (setup) → train (a distributed job on the trial's own cluster; retry = resume) →
release (teardown) → select_best (after every trial, failed ones too) → register (the best
trial's model, scored on the test split, registered with its model card; the review DAG runs
the gate). The sweep is the config's ``sweep`` section or the ``sweep`` Param: grid or random
over config fields, the metric and its direction, ASHA pruning (``min_epochs``,
``reduction_factor``), and ``parallel``: at most that many trials hold a cluster at once, up to
the deployment's cap ``MXPIPE_SWEEP_PARALLEL``. The tasks and their wiring are
``plugins.sweep_dag``; this file names the DAG and sets its limits from the settings.

Light like every DAG file here: Airflow's SDK and the project's light task modules, no I/O at
parse time.
"""
from __future__ import annotations

from common.settings import settings
from plugins.sweep_dag import sweep_dag

_SETTINGS = settings()
mxnet_sweep = sweep_dag("mxnet_sweep", parallel=_SETTINGS.sweep_parallel, train_timeout_s=_SETTINGS.train_timeout_s,
                        dagrun_timeout_s=_SETTINGS.dagrun_timeout_s, deferrable=_SETTINGS.train_deferrable,
                        doc_md=__doc__)
