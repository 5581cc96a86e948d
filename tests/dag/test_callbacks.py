"""The failure and retry callbacks are wired on every task of the training DAG and write one
line naming the dag, task, attempt and cause."""
import logging
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.dag


def test_every_task_has_both_callbacks(dag):
    from plugins import callbacks

    for task in dag.tasks:
        assert callbacks.on_failure in _as_list(task.on_failure_callback), task.task_id
        assert callbacks.on_retry in _as_list(task.on_retry_callback), task.task_id


def _as_list(cb):
    return cb if isinstance(cb, list) else [cb]


def test_retry_and_failure_lines(caplog):
    from plugins import callbacks

    ti = SimpleNamespace(dag_id="mxnet_training", task_id="train", run_id="manual__x", try_number=2, map_index=-1)
    ctx = {"ti": ti, "task": SimpleNamespace(retries=2), "exception": RuntimeError("worker-1 died\ntraceback...")}
    caplog.set_level(logging.INFO, logger="mxpipe.callbacks")
    callbacks.on_retry(ctx)
    callbacks.on_failure({**ctx, "ti": SimpleNamespace(**{**ti.__dict__, "task_id": "validate_shard",
                                                          "map_index": 3})})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "task up for retry: dag=mxnet_training task=train run=manual__x attempt=2/3 why=RuntimeError: worker-1 died",
        "task failed: dag=mxnet_training task=validate_shard[3] run=manual__x attempt=2/3 "
        "why=RuntimeError: worker-1 died",
    ]
