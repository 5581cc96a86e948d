"""Test-only Airflow DAG file: the training DAG (``plugins.training_dag``) under other ids with the
limits the operator tests need, so one Airflow stack runs them all side by side with the shipped
``mxnet_training`` (``operator_runs.variants_stack`` links this file into its DAG folder).

What differs between them is read when a DAG is parsed (``execution_timeout``, ``dagrun_timeout``,
``deferrable``), hence a DAG per limit rather than a stack per limit. Each has its own
``max_active_runs`` slot, so a reference run proceeds while another test's run trains.
Light at parse time, like a DAG file: the factory only.
"""
from __future__ import annotations

from plugins.training_dag import training_dag

# The train task's limit, counted from its job's start.
TRAIN_TIMEOUT_S = 90
# From the run's start: shard, validate and provision come first (a minute or two here).
DAGRUN_TIMEOUT_S = 300

REFERENCE = "mxnet_training_reference"
TRAIN_TIMEOUT = "mxnet_training_train_timeout"
RUN_TIMEOUT = "mxnet_training_run_timeout"
# The operator polling in its task process (MXPIPE_TRAIN_DEFERRABLE=0's DAG): one DAG for the run
# whose task is killed, one for its uninterrupted reference.
SYNC = "mxnet_training_sync"
SYNC_REFERENCE = "mxnet_training_sync_reference"

_NONE = {"train_timeout_s": 0.0, "dagrun_timeout_s": 0.0, "deferrable": True}
VARIANTS = {
    REFERENCE: _NONE,
    TRAIN_TIMEOUT: {**_NONE, "train_timeout_s": TRAIN_TIMEOUT_S},
    RUN_TIMEOUT: {**_NONE, "dagrun_timeout_s": DAGRUN_TIMEOUT_S},
    SYNC: {**_NONE, "deferrable": False},
    SYNC_REFERENCE: {**_NONE, "deferrable": False},
}

# Module globals, where Airflow's DagBag finds them.
globals().update({dag_id: training_dag(dag_id, **limits) for dag_id, limits in VARIANTS.items()})
