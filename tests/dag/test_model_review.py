"""The review DAG file: scheduled on the model Asset, and wired so that
Approve runs ``promote`` only and Reject runs ``reject`` only (the human wait itself is driven
by a reviewer through Airflow's API). Its parse is held to the no-heavy-imports policy in
test_dag_file.py; its parse time is a benchmark (benchmarks/parse_time.py), not a timed test."""
from datetime import timedelta

import pytest

pytestmark = pytest.mark.dag


@pytest.fixture(scope="module")
def dag(dagbag):
    return dagbag.dags["model_review"]


def test_scheduled_on_the_registered_model_asset(dag):
    from plugins.review_tasks import model_asset

    condition = dag.timetable.asset_condition
    assert type(condition).__name__ == "AssetAny"
    assert [a.uri for a in condition.objects] == [model_asset("digits-classifier").uri]
    assert dag.catchup is False


def test_structure_and_decision_wiring(dag):
    tasks = {t.task_id: t for t in dag.tasks}
    assert set(tasks) == {"resolve", "compare", "gate", "approval", "promote", "reject"}
    approval = tasks["approval"]
    from airflow.providers.standard.operators.hitl import ApprovalOperator

    assert isinstance(approval, ApprovalOperator)
    assert approval.response_timeout == timedelta(hours=72)
    assert approval.execution_timeout is not None and approval.retries == 0
    assert "comment" in approval.params
    # ApprovalOperator skips its *direct* downstream on Reject: promote must be the only one.
    assert approval.downstream_task_ids == {"promote"}
    assert tasks["reject"].upstream_task_ids == {"promote"}
    assert tasks["reject"].trigger_rule == "all_skipped"
    assert {"resolve", "compare"} <= tasks["promote"].upstream_task_ids
    assert all(t.execution_timeout is not None for t in tasks.values())


def test_gate_sits_between_compare_and_approval_and_skips_all_after_it(dag):
    from airflow.providers.standard.operators.python import ShortCircuitOperator

    from plugins.review_tasks import DEFAULT_GATE

    tasks = {t.task_id: t for t in dag.tasks}
    gate = tasks["gate"]
    assert isinstance(gate, ShortCircuitOperator)
    assert {"resolve", "compare"} <= gate.upstream_task_ids and gate.downstream_task_ids == {"approval"}
    assert tasks["approval"].upstream_task_ids == {"gate"}
    # A failed gate skips approval, promote and reject alike (reject's all_skipped would run).
    assert gate.ignore_downstream_trigger_rules is True
    assert dag.params["gate"] == DEFAULT_GATE
    assert "xcom_pull(task_ids='gate'" in tasks["approval"].body


@pytest.mark.parametrize("name,bad", [("model_name", "bad name!"), ("version", "v1"), ("version", 3),
                                      ("shards_prefix", "relative/path"), ("gate", {}),
                                      ("gate", {"accuracy_score": {"threshold": 0.9}}),
                                      ("gate", {"accuracy_score": {"greater_is_better": True}}),
                                      ("gate", {"accuracy_score": {"greater_is_better": True,
                                                                   "min_absolute_change": -0.01}})])
def test_params_reject_bad_values(dag, name, bad):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(dag.params)
    with pytest.raises(ParamValidationError):
        params[name] = bad
