"""The project's DAG on the real Airflow stack (api-server, scheduler, dag-processor, triggerer,
LocalExecutor, SQLite), exactly as ``make demo`` runs it: triggered over the REST API, run by
the scheduler, against real SeaweedFS and MLflow servers from the fixtures."""

import pytest
from common import storage
from infra.airflow_client import AirflowAPIError, AirflowClient, trigger_dag_run, wait_for_dag_run
from testkit.airflow_stack import airflow_stack

pytestmark = pytest.mark.integration

DAG_ID = "mxnet_training"


@pytest.fixture(scope="module")
def stack(s3_server, mlflow_server, tmp_path_factory):
    with airflow_stack(tmp_path_factory.mktemp("stack-home"), s3_server, mlflow_server,
                       {DAG_ID: "mxnet_training.py"}) as cfg:
        yield cfg


def _dataset(bucket, csv):
    uri = f"s3://{bucket}/stack-test/digits.csv"
    storage.put_bytes(uri, csv)
    return uri


def test_out_of_range_param_is_rejected_at_trigger(stack):
    with pytest.raises(AirflowAPIError, match="num_workers") as err:
        trigger_dag_run(stack.airflow_url, DAG_ID, {"num_workers": 0})
    assert "HTTP 400" in str(err.value)


def test_scheduler_runs_the_dag_to_a_registered_model(stack, s3_server, digits_csv):
    # The debug recipe as it is (the form's fields left at their defaults set nothing): 3 epochs
    # at a constant rate, no dropout.
    # Sharded in 2 mapped parts (byte ranges of the one CSV file), each its own task process.
    conf = {"dataset_uri": _dataset(s3_server.bucket, digits_csv), "recipe": "debug",
            "registered_model_name": "digits-stack-test", "shard_parts": 2}
    run_id = trigger_dag_run(stack.airflow_url, DAG_ID, conf)
    state = wait_for_dag_run(stack.airflow_url, DAG_ID, run_id, timeout_s=600, poll_s=3)
    with AirflowClient(stack.airflow_url) as client:
        states = client.task_states(DAG_ID, run_id)
        assert state == "success", states
        path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/register/xcomEntries/return_value"
        registered = client.request("GET", path, params={"deserialize": "true"}).json()["value"]
    assert states.pop("reuse") == "skipped"  # the branch not taken: this run trains
    assert set(states.values()) == {"success"}
    assert {"shard_count[0]", "shard_count[1]", "shard_part[0]", "shard_part[1]", "shard_merge"} <= set(states)
    assert registered["registered_model_name"] == "digits-stack-test"
    assert registered["test_accuracy"] > 0.85

    # The same conf again, as a scheduled retraining on unchanged data would be: the scheduler
    # runs check_reuse's branch to reuse, and nothing is provisioned, trained or registered.
    again = trigger_dag_run(stack.airflow_url, DAG_ID, conf)
    state = wait_for_dag_run(stack.airflow_url, DAG_ID, again, timeout_s=300, poll_s=3)
    with AirflowClient(stack.airflow_url) as client:
        states = client.task_states(DAG_ID, again)
        assert state == "success", states
        path = f"/dags/{DAG_ID}/dagRuns/{again}/taskInstances/reuse/xcomEntries/return_value"
        reused = client.request("GET", path, params={"deserialize": "true"}).json()["value"]
    assert {t: states[t] for t in ("check_reuse", "reuse", "provision", "train", "release", "register")} == {
        "check_reuse": "success", "reuse": "success", "provision": "skipped", "train": "skipped",
        "release": "skipped", "register": "skipped"}, states
    assert (reused["version"], reused["reused_from"]["run_id"]) == (registered["version"], run_id)
