"""A hyperparameter sweep through the real Airflow stack (scheduler, LocalExecutor, triggerer)
against the S3 and MLflow fixtures: a grid of 6 trials of the digits debug config, 2 at once by
the run's ``sweep.parallel`` under a deployment cap of 3 (``MXPIPE_SWEEP_PARALLEL``): the trials'
gates, not the cap, keep no more than 2 trials between provision and release at any time (read
from the task instances' start and end times), and 2 do run at once.

Trials 0-2 are 2-worker ps-lite jobs on local clusters of their own, with ASHA pruning at
epochs 1 and 2; worker 1 of the first trial to reach step 25 is killed (``training.loop.faults``,
once; a step of epoch 1, which a trial pruned at epoch 1 never reaches), and since
``cluster.max_restarts_without_progress`` is 0 the job fails and the train
task's retry resumes it from its checkpoint. Trials 3-5 ask for the ``hosts`` backend, which this
stack has no settings for: their provision fails (no retry), and the sweep goes on without them.
The sweep finishes and registers its best trial; the trials are child runs of the sweep's MLflow
run, which holds the sweep's cost and the pruning's savings.

A bad sweep is refused by the first task, naming the field, before anything is sharded (its run
goes on beside the sweep's, so the module waits for one run).

The learning rates are chosen so the pruning fires whatever the order the trials reach a rung
in: trial 2 (2e-5) passes its gate only once trial 0 or 1 was released (two at once), and is far
worse at epoch 1 than trial 0 (5e-3), so at rung 0 (2 or 3 trials there, eta 2) it is not the
best."""
import json
import time

import pytest

from common import storage
from common.paths import RunPaths
from infra.airflow_client import AirflowClient, trigger_dag_run, wait_for_dag_run
from testkit.airflow_stack import airflow_stack

pytestmark = pytest.mark.integration

DAG_ID = "mxnet_sweep"
# The deployment's cap, above the run's sweep.parallel: the run's own value must hold.
CAP, PARALLEL = 3, 2
KILL_STEP = 25
RATES = [0.005, 0.00001, 0.00002]
REAL, FAILING = [0, 1, 2], [3, 4, 5]
MODEL_NAME = "digits-sweep-test"


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory):
    return tmp_path_factory.mktemp("sweep-fault") / "fired"


@pytest.fixture(scope="module")
def stack(s3_server, mlflow_server, tmp_path_factory, fault_file):
    env = {"MXPIPE_TRAIN_POLL_S": "0.5", "MXPIPE_SWEEP_PARALLEL": str(CAP), "MXPIPE_LIVE_SYNC_S": "2",
           "MXPIPE_GX_DATA_DOCS": "0", "MXPIPE_MAX_ACTIVE_RUNS": "2",
           "MXPIPE_FAULT_KILL_STEP": str(KILL_STEP), "MXPIPE_FAULT_KILL_RANK": "1",
           "MXPIPE_FAULT_ONCE_FILE": str(fault_file)}
    with airflow_stack(tmp_path_factory.mktemp("sweep-home"), s3_server, mlflow_server, {DAG_ID: "mxnet_sweep.py"},
                       extra_env=env) as cfg:
        yield cfg


@pytest.fixture(scope="module")
def dataset(s3_server, digits_csv):
    uri = f"s3://{s3_server.bucket}/sweep-test/digits.csv"
    storage.put_bytes(uri, digits_csv)
    return uri


def _failed_logs(client, run_id, instances):
    """The tail of every failed task instance's log (what a reader of the failure needs)."""
    out = []
    for ti in instances:
        if ti["state"] in ("failed", "up_for_retry") or ti["try_number"] > 1:
            entries = client.task_log(DAG_ID, run_id, ti["task_id"], ti["try_number"], ti.get("map_index", -1))
            out.append(f"--- {ti['task_id']}[{ti.get('map_index')}] try {ti['try_number']}: "
                       + "\n".join(str(e.get("event", "")) for e in entries)[-3000:])
    return "\n".join(out)


def _at(text):
    from datetime import datetime

    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _print_timeline(instances):
    """Each task instance's start and end, seconds after the first start (where a run's time goes)."""
    def at(text):
        return _at(text) if text else None

    started = [at(ti.get("start_date")) for ti in instances if ti.get("start_date")]
    zero = min(started) if started else 0
    for ti in sorted(instances, key=lambda t: at(t.get("start_date")) or 1e12):
        start, end = at(ti.get("start_date")), at(ti.get("end_date"))
        print(f"{ti['task_id']}[{ti.get('map_index')}] try {ti['try_number']} {ti['state']}: "
              + (f"{start - zero:.0f}s → {end - zero:.0f}s" if start and end else "-"))


def _most_holding_a_cluster(instances):
    """The most trials at once between their provision's start and their release's end (a cluster
    is held within that span: a superset of the time it is held), from Airflow's task instances;
    and each trial's span."""
    by = {(ti["task_id"], ti["map_index"]): ti for ti in instances}
    spans = {}
    for (task_id, index), ti in by.items():
        if task_id == "trial.provision" and ti.get("start_date"):
            ends = [t["end_date"] for t in (ti, by.get(("trial.release", index))) if t and t.get("end_date")]
            spans[index] = (_at(ti["start_date"]), max(_at(e) for e in ends))
    # An end sorts before a start at the same instant: the trial released, the next one admitted.
    events = sorted([(start, 1) for start, _ in spans.values()] + [(end, -1) for _, end in spans.values()])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most, spans


def _xcom(client, run_id, task_id, key="return_value"):
    path = f"/dags/{DAG_ID}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}"
    return client.request("GET", path, params={"deserialize": "true"}).json()["value"]


BAD_CONF = {"recipe": "debug", "sweep": {"space": {"optim.learning_rate": [0.01], "optim.epochs": ["3"]}}}


@pytest.fixture(scope="module")
def runs(stack, dataset):
    """The module's two runs, triggered together (``MXPIPE_MAX_ACTIVE_RUNS=2``): the bad sweep
    fails in its first task while the sweep shards, so the module waits for one run, not two."""
    conf = {"dataset_uri": dataset, "recipe": "debug", "registered_model_name": MODEL_NAME,
            # Synchronous checkpoint writes: the one before the kill is committed when it comes.
            "config": {"cluster": {"max_restarts_without_progress": 0}, "checkpoint": {"async_upload": False}},
            "sweep": {"space": {"cluster.backend": ["local", "hosts"], "optim.learning_rate": RATES},
                      "parallel": PARALLEL, "metric": "val_loss",
                      "min_epochs": 1, "reduction_factor": 2}}
    started = time.monotonic()
    bad_id = trigger_dag_run(stack.airflow_url, DAG_ID, {"dataset_uri": dataset, **BAD_CONF})
    run_id = trigger_dag_run(stack.airflow_url, DAG_ID, conf)
    bad_state = wait_for_dag_run(stack.airflow_url, DAG_ID, bad_id, timeout_s=300, poll_s=1)
    state = wait_for_dag_run(stack.airflow_url, DAG_ID, run_id, timeout_s=900, poll_s=2)
    print(f"sweep run {run_id}: {state} in {time.monotonic() - started:.0f}s")
    return {"bad": (bad_id, bad_state), "sweep": (run_id, state)}


def test_a_bad_sweep_fails_the_first_task_naming_the_field_before_sharding(stack, runs):
    run_id, state = runs["bad"]
    with AirflowClient(stack.airflow_url) as client:
        states = client.task_states(DAG_ID, run_id)
        log = "\n".join(str(e.get("event", "")) for e in client.task_log(DAG_ID, run_id, "shard"))
    assert state == "failed" and states["shard"] == "failed", states
    assert "optim.epochs must be an integer, got '3' (a string)" in log, log[-3000:]
    assert states.get("shard_merge") in ("upstream_failed", None), states  # nothing was sharded


def test_a_sweep_with_a_killed_trial_prunes_and_registers_its_best_trial(stack, runs, fault_file, mlflow_server,
                                                                         s3_server):
    run_id, state = runs["sweep"]
    with AirflowClient(stack.airflow_url) as client:
        instances = client.task_instances(DAG_ID, run_id)
        states = client.task_states(DAG_ID, run_id)
        assert state == "success", (states, _failed_logs(client, run_id, instances))
        best = _xcom(client, run_id, "select_best")
        registered = _xcom(client, run_id, "register")
    _print_timeline(instances)
    trains = {ti["map_index"]: ti for ti in instances if ti["task_id"] == "trial.train"}
    assert sorted(trains) == REAL + FAILING, states
    # The run's sweep.parallel, not the deployment's cap, bounds the trials holding a cluster; and
    # the sweep used it (2 at once), every trial let through its gate.
    most, spans = _most_holding_a_cluster(instances)
    assert most == PARALLEL, (most, spans)
    gates = {ti["map_index"]: ti for ti in instances if ti["task_id"] == "trial.gate"}
    assert all(gates[i]["state"] == "success" for i in REAL + FAILING), states
    assert all(gates[i]["rendered_map_index"].startswith(f"trial {i}: ") for i in gates), gates  # its trial's label
    assert all(trains[i]["state"] == "success" for i in REAL), states
    assert all(states[f"trial.release[{i}]"] == "success" for i in REAL), states  # every cluster released
    # A failed trial does not fail the sweep: the hosts trials failed to provision, nothing trained.
    assert all(states[f"trial.provision[{i}]"] == "failed" for i in FAILING), states
    assert all(trains[i]["state"] == "upstream_failed" for i in FAILING), states
    # The kill fired once, in one trial, and its train task's retry resumed from its checkpoint.
    assert fault_file.exists()
    retried = [i for i, ti in trains.items() if ti["try_number"] > 1]
    assert len(retried) == 1, {i: ti["try_number"] for i, ti in trains.items()}
    killed = retried[0]
    paths = RunPaths(s3_server.env["MXPIPE_ARTIFACT_ROOT"], DAG_ID, f"{run_id}.trial-{killed}")
    metrics = json.loads(storage.get_bytes(storage.join(paths.metrics, "train.json")))
    assert 0 < metrics["resumed_from"] < KILL_STEP, metrics.get("resumed_from")
    # Pruning fired: trial 2 at least stopped at rung 0 (after epoch 1 of 3).
    outcomes = best["summary"]
    assert "pruned" in outcomes and "3 failed" in outcomes, outcomes
    # The best trial is the best learning rate, registered as a normal run would be.
    assert best["trial"] == 0 and best["trial_run_id"] == f"{run_id}.trial-0", best
    assert registered["registered_model_name"] == MODEL_NAME and registered["test_accuracy"] > 0.85

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.tracking_uri)
    exp = client.get_experiment_by_name("mxnet-pipeline")
    (parent,) = client.search_runs([exp.experiment_id], filter_string=f"tags.`airflow.run_id` = '{run_id}'")
    children = client.search_runs([exp.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(c.data.tags["mxpipe.sweep.trial"] for c in children) == [str(i) for i in REAL + FAILING]
    by_trial = {c.data.tags["mxpipe.sweep.trial"]: c for c in children}
    assert by_trial["2"].data.tags["sweep.outcome"] == "pruned"
    from training.launch.status import read_status

    pruned = RunPaths(s3_server.env["MXPIPE_ARTIFACT_ROOT"], DAG_ID, f"{run_id}.trial-2").job_status
    assert read_status(pruned).state == "succeeded" and read_status(pruned).outcome == "pruned"
    assert all(by_trial[str(i)].data.tags["sweep.outcome"] == "failed" for i in FAILING)
    version = client.get_model_version(MODEL_NAME, registered["version"])
    assert version.run_id == by_trial["0"].info.run_id  # the best trial's run holds the version
    m = parent.data.metrics
    assert m["sweep.trials"] == 6 and m["sweep.best_trial"] == 0 and m["sweep.pruned"] >= 1 and m["sweep.failed"] == 3
    assert m["sweep.full_epochs"] == 18 and m["sweep.epochs_saved_by_pruning"] >= 2
    assert m["sweep.cost.core_seconds"] > 0  # the trials' live runs' cost, summed
    print({k: round(v, 3) for k, v in sorted(m.items()) if k.startswith("sweep.")})
