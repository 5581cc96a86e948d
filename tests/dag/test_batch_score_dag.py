"""The batch-scoring DAG file: triggered by the "scoring input landed" Asset, the checks before
the mapped scoring, and Params that refuse a bad version or drift limit at trigger time. Its
parse is held to the no-heavy-imports policy in test_dag_file.py."""
import pytest

pytestmark = pytest.mark.dag


@pytest.fixture(scope="module")
def dag(dagbag):
    return dagbag.dags["mxnet_batch_score"]


def test_scheduled_on_the_score_input_asset(dag):
    condition = dag.timetable.asset_condition
    assert [a.uri for a in condition.objects] == ["x-mxpipe://score-input/landed"]
    assert dag.catchup is False


def test_checks_come_before_the_mapped_scoring(dag):
    tasks = {t.task_id: t for t in dag.tasks}
    assert set(tasks) == {"resolve", "needs_scoring", "check", "score_part", "finish"}
    assert type(tasks["score_part"]).__name__.endswith("MappedOperator")
    assert tasks["check"].upstream_task_ids == {"resolve", "needs_scoring"}
    assert tasks["score_part"].upstream_task_ids == {"resolve", "check"}
    assert tasks["finish"].upstream_task_ids == {"resolve", "score_part"}


@pytest.mark.parametrize("name,bad", [("version", "champion"), ("drift", {"max_mean_shift": 0}),
                                      ("drift", {"max_mean": 1.0}), ("chunk_rows", 10)])
def test_bad_params_are_refused(dag, name, bad):
    from airflow.sdk.definitions.param import ParamsDict

    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(dag.params)
    with pytest.raises(ParamValidationError, match=name):
        params[name] = bad
