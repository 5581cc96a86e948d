"""The sweep DAG as the real DagBag parses it: the training DAG's sharding and validation, the
trial plan, one mapped task group per trial (a gate that holds no slot of the cap, setup, the
durable train operator, teardown, at most the cap at once), the selection after every trial whatever its end, the training DAG's register;
and its ``sweep`` Param, which refuses a malformed sweep when the run is triggered."""
import pytest

pytestmark = pytest.mark.dag


@pytest.fixture(scope="module")
def sweep(dagbag):
    return dagbag.dags["mxnet_sweep"]


def test_structure(sweep, dag):
    tasks = {t.task_id: t for t in sweep.tasks}
    shared = {"shard", "shard_parts", "shard_count", "shard_part", "shard_merge", "shard_names", "validate_shard",
              "validate", "register"}
    assert set(tasks) == shared | {"plan_trials", "trial.gate", "trial.provision", "trial.train",
                                         "trial.release", "select_best"}
    assert shared <= {t.task_id for t in dag.tasks}  # the training DAG's own tasks
    # Nothing is planned, provisioned or trained before the data passed validation.
    assert "validate" in tasks["plan_trials"].upstream_task_ids
    assert "plan_trials" in tasks["trial.gate"].upstream_task_ids
    # A trial takes a cluster only once its gate let it (the run's sweep.parallel).
    assert "trial.gate" in tasks["trial.provision"].upstream_task_ids
    for name in ("trial.gate", "trial.provision", "trial.train", "trial.release"):  # one group instance per trial
        assert type(tasks[name].task_group).__name__ == "MappedTaskGroup", name
    assert tasks["trial.provision"].is_setup and tasks["trial.release"].is_teardown
    assert {"trial.provision", "trial.train"} <= tasks["trial.release"].upstream_task_ids
    assert type(tasks["trial.train"]).__name__ == "TrainJobOperator"
    assert tasks["trial.train"].retries >= 2  # a killed trial resumes
    cap = tasks["trial.train"].max_active_tis_per_dagrun
    assert cap == tasks["trial.provision"].max_active_tis_per_dagrun == 2  # MXPIPE_SWEEP_PARALLEL
    # A waiting gate holds no slot of that cap (nor a worker: deferred, or rescheduled), so it never
    # keeps the trial it waits for from provisioning or training; its wait is bounded.
    gate = tasks["trial.gate"]
    assert type(gate).__name__ == "TrialGateSensor" and gate.max_active_tis_per_dagrun is None
    assert gate.mode == "reschedule" and gate.deferrable and 0 < gate.timeout < float("inf")
    assert gate.retries >= 1  # a passing API error; a timeout fails it for good (AirflowSensorTimeout)
    # The selection runs whatever the trials' ends (a failed trial does not stop the sweep).
    assert tasks["select_best"].trigger_rule == "all_done" and "trial.train" in tasks["select_best"].upstream_task_ids
    assert {"select_best", "validate", "shard_merge"} <= tasks["register"].upstream_task_ids
    assert [o.name for o in tasks["register"].outlets] == ["mxpipe.model", "mxpipe.registered_model"]
    assert type(sweep.timetable).__name__ == "NullTimetable"  # triggered, never scheduled


@pytest.mark.parametrize("bad", [{"space": {"optim.learning_rate": []}},
                                 {"space": {"optim.learning_rate": {"low": 0.1}}},
                                 {"space": {}}, {"method": "bayes"}, {"trials": 0}, {"parallel": "2"},
                                 {"reduction_factor": 1}, {"space": {"optim.epochs": 3}}, {"nosuch": 1}])
def test_the_sweep_param_refuses_a_malformed_sweep_when_triggered(sweep, bad):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(sweep.params)
    with pytest.raises(ParamValidationError):
        params["sweep"] = bad


def test_the_sweep_param_takes_a_grid_and_a_random_search(sweep):
    from airflow.sdk.definitions.param import ParamsDict

    params = ParamsDict(sweep.params)
    params["sweep"] = {"space": {"optim.learning_rate": [0.01, 0.001]}, "min_epochs": 1}
    params["sweep"] = {"method": "random", "trials": 5,
                       "space": {"optim.learning_rate": {"low": 1e-4, "high": 1e-1, "log": True}}}
