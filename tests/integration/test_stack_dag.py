"""The project's DAG on the real Airflow stack (api-server, scheduler, dag-processor, triggerer,
LocalExecutor, SQLite), exactly as ``make demo`` runs it: triggered over the REST API, run by
the scheduler, against real SeaweedFS and MLflow servers from the fixtures."""

import json
from datetime import datetime

import pytest
from common import storage
from infra.airflow_client import AirflowAPIError, AirflowClient, trigger_dag_run, wait_for_dag_run
from testkit.airflow_stack import airflow_stack

pytestmark = pytest.mark.integration

DAG_ID = "mxnet_training"
POLL_S = 0.25


@pytest.fixture(scope="module")
def stack(s3_server, mlflow_server, tmp_path_factory):
    # The train task polls its job every POLL_S: a short debug job still spans many polls, so the
    # log test below tells a credential line per poll from one per poll run.
    with airflow_stack(tmp_path_factory.mktemp("stack-home"), s3_server, mlflow_server,
                       {DAG_ID: "mxnet_training.py"}, extra_env={"MXPIPE_TRAIN_POLL_S": str(POLL_S)}) as cfg:
        yield cfg


def _dataset(bucket, csv):
    uri = f"s3://{bucket}/stack-test/digits.csv"
    storage.put_bytes(uri, csv)
    return uri


REFUSED_BASE = {"dataset_uri": "s3://mxpipe/nonexistent/digits.csv", "recipe": "debug", "num_workers": 2}
# (what is wrong, conf overrides, text the rejection must contain)
REFUSED_AT_TRIGGER = [
    ("wrong type: string epochs", {"epochs": "ten"}, "epochs"),
    ("wrong type: fractional batch size", {"batch_size": 2.5}, "batch_size"),
    ("out of range: too many workers", {"num_workers": 17}, "num_workers"),
    ("out of range: zero learning rate", {"learning_rate": 0}, "learning_rate"),
    ("unknown optimizer", {"optimizer": "adamw"}, "adamw"),
    ("unknown model", {"model": "vgg19"}, "vgg19"),
    ("unknown kvstore mode", {"kvstore": "local"}, "kvstore"),
    ("unknown backend", {"backend": "k8s"}, "k8s"),
    ("malformed S3 URI (one slash)", {"dataset_uri": "s3:/mxpipe/data.csv"}, "dataset_uri"),
    ("malformed S3 URI (bucket name)", {"dataset_uri": "s3://Bad_Bucket/data.csv"}, "dataset_uri"),
    ("warm start that is no run id", {"warm_start": "no such run!"}, "warm_start"),
    ("wrong type in config: 'false' for a boolean", {"config": {"checkpoint": {"elastic": "false"}}},
     "On instance['checkpoint']['elastic']"),
    ("wrong type in config: fractional workers", {"config": {"cluster": {"num_workers": 2.5}}},
     "2.5 is not of type 'integer'"),
    ("unknown key in config", {"config": {"optim": {"epochz": 3}}}, "'epochz' was unexpected"),
    ("malformed import path of a custom network", {"config": {"model": {"name": "my-net.arch:build"}}},
     "'my-net.arch:build' does not match"),
    ("config file that is neither JSON nor YAML", {"config_uri": "/etc/run.txt"}, "config_uri"),
]


@pytest.mark.parametrize("index", range(len(REFUSED_AT_TRIGGER)), ids=[k for k, _, _ in REFUSED_AT_TRIGGER])
def test_a_bad_param_is_refused_at_trigger_with_a_readable_message(stack, index):
    """The REST API (what the UI's trigger form calls) validates the conf against the Params'
    schema when it creates the run: HTTP 400 with the message naming the field, and no run."""
    _, overrides, expected = REFUSED_AT_TRIGGER[index]
    with AirflowClient(stack.airflow_url) as client:
        runs_before = len(client.dag_runs(DAG_ID))
    with pytest.raises(AirflowAPIError) as err:
        trigger_dag_run(stack.airflow_url, DAG_ID, {**REFUSED_BASE, **overrides})
    assert "HTTP 400" in str(err.value) and expected in str(err.value), str(err.value)
    with AirflowClient(stack.airflow_url) as client:
        assert len(client.dag_runs(DAG_ID)) == runs_before  # refused: no run was created


@pytest.fixture(scope="module")
def registered_run(stack, s3_server, digits_csv):
    """One run of the DAG through the scheduler (the debug recipe as it is: the form's fields
    left at their defaults set nothing; 3 epochs at a constant rate, no dropout): its run id and
    final state and its conf, for every test that reads it."""
    # Sharded in 2 mapped parts (byte ranges of the one CSV file), each its own task process.
    conf = {"dataset_uri": _dataset(s3_server.bucket, digits_csv), "recipe": "debug",
            "registered_model_name": "digits-stack-test", "shard_parts": 2}
    run_id = trigger_dag_run(stack.airflow_url, DAG_ID, conf)
    return run_id, wait_for_dag_run(stack.airflow_url, DAG_ID, run_id, timeout_s=600, poll_s=3), conf


def test_scheduler_runs_the_dag_to_a_registered_model(stack, registered_run):
    run_id, state, conf = registered_run
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


def test_the_train_tasks_log_shows_the_jobs_epochs_and_no_credential_line_per_poll(stack, registered_run):
    """What a person reads on the train task's page (the API the UI reads): the job's log relayed
    from storage as it grew, each epoch's line (loss, validation metric, throughput, ETA) from its
    typed event, the log's storage URI (not a file on the supervisor's host), and the S3
    connection resolved once per poll run, not once per poll."""
    run_id, state, _ = registered_run
    assert state == "success"
    with AirflowClient(stack.airflow_url) as client:
        entries = client.task_log(DAG_ID, run_id, "train")
    lines = [str(e.get("event", "")) for e in entries]
    text = "\n".join(lines)
    epochs = [ln for ln in lines if "/3 done at global step" in ln]
    assert len(epochs) >= 3, text[-6000:]  # rank 0's three epochs (and the other worker's)
    assert all("loss " in ln and "samples/s" in ln and "ETA " in ln for ln in epochs), epochs
    assert any("val_accuracy " in ln for ln in epochs), epochs  # rank 0 evaluates
    assert any("[worker-0@" in ln for ln in lines), text[-6000:]  # the roles' own lines, prefixed
    started = [ln for ln in lines if "started training job" in ln]
    assert started and "/job_logs/" in started[0] and "s3://" in started[0], started
    assert not any(".log" in ln.split("its log:")[-1] for ln in started), started
    # The trigger polled for as long as its lines span (one read every POLL_S), at least 6 times:
    # a lookup per poll would log a credential line each time; now the task process, the trigger
    # and the resumed task log one each.
    polled = [datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")) for e in entries
              if "train_trigger" in str(e.get("logger", "")) and e.get("timestamp")]
    span_s = (max(polled) - min(polled)).total_seconds()
    credentials = [ln for ln in lines if "credentials retrieved" in ln]
    assert span_s >= 6 * POLL_S and len(credentials) <= 3, (span_s, credentials)


def test_a_tasks_log_is_in_s3_and_read_back_from_there(stack, registered_run, s3_server):
    """Airflow's remote logging (the Amazon provider's, with the stack's ``aws_default``
    connection on SeaweedFS): the train task's log (its trigger's lines too) is uploaded, and the
    API server shows it with the local copy gone, as a reader on another host would see it."""
    import shutil

    run_id, _, _ = registered_run
    prefix = f"s3://{s3_server.bucket}/airflow-logs/dag_id={DAG_ID}/run_id={run_id}/task_id=train/"
    uploaded = [uri for uri in storage.list_uris(prefix)]
    assert uploaded, f"nothing under {prefix}"
    local = stack.home / "airflow" / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}" / "task_id=train"
    assert local.is_dir()
    shutil.rmtree(local)  # what the API server reads now can only come from S3
    with AirflowClient(stack.airflow_url) as client:
        entries = client.task_log(DAG_ID, run_id, "train")
    text = "\n".join(json.dumps(e) for e in entries)
    assert "/3 done at global step" in text, text[-4000:]
    assert f"s3://{s3_server.bucket}/airflow-logs/" in text, text[:2000]  # the source the reader names
