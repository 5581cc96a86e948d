"""The DAG file: imports cleanly, stays light at parse time, and has the structure and policy
the pipeline relies on (setup/teardown, retries, params with bounds)."""
import pytest

from tests.dag.parse_probe import parse_in_fresh_process
from testkit import REPO

pytestmark = pytest.mark.dag


@pytest.mark.parametrize("dag_file", ["mxnet_training.py", "dataset_landed.py", "model_review.py",
                                      "mxnet_batch_score.py", "mxnet_sweep.py"])
def test_parse_loads_nothing_heavy(dag_file):
    """In a fresh interpreter, importing the DAG file loads none of the heavy packages.
    (Its parse time is measured in benchmarks/parse_time.py, not asserted here.)"""
    assert parse_in_fresh_process(dag_file)["heavy"] == []


def test_structure(dag):
    tasks = {t.task_id: t for t in dag.tasks}
    assert set(tasks) == {"shard", "shard_parts", "shard_count", "shard_part", "shard_merge", "shard_names",
                          "validate_shard", "validate", "check_reuse", "provision", "train", "release", "register",
                          "reuse"}
    # Sharding: planned, then counted and sharded part by part (mapped), then merged.
    for mapped in ("shard_count", "shard_part"):
        assert type(tasks[mapped]).__name__.endswith("MappedOperator")
        assert "shard_parts" in tasks[mapped].upstream_task_ids
    assert "shard_count" in tasks["shard_part"].upstream_task_ids
    assert {"shard", "shard_part"} <= tasks["shard_merge"].upstream_task_ids
    assert tasks["shard_merge"].trigger_rule == "none_failed"  # also after skipped parts (reused shards)
    assert "shard_merge" in tasks["shard_names"].upstream_task_ids
    # One validation task per shard (mapped), then the cross-shard task, which waits for all of them.
    assert type(tasks["validate_shard"]).__name__.endswith("MappedOperator")
    assert "validate_shard" in tasks["validate"].upstream_task_ids
    assert tasks["provision"].is_setup and tasks["release"].is_teardown
    # Nothing is provisioned before the data has passed validation and the reuse check chose to train.
    assert "validate" in tasks["check_reuse"].upstream_task_ids
    assert tasks["check_reuse"].downstream_task_ids == {"provision", "train", "register", "reuse"}
    # train loads the warm start check_reuse resolved (one resolution per run: the reuse
    # decision's, whatever the reference names by the time train or its retry starts)
    warm = tasks["train"].warm_start
    assert (warm.operator.task_id, warm.key) == ("check_reuse", "warm_start") and "warm_start" in tasks[
        "train"].template_fields
    assert type(tasks["check_reuse"]).__name__ == "_BranchPythonDecoratedOperator"
    assert {"provision", "train"} <= tasks["release"].upstream_task_ids
    # register and train are downstream of provision, so the branch to provision skips neither.
    assert {"train", "register"} <= tasks["provision"].get_flat_relative_ids(upstream=False)
    assert tasks["train"].retries >= 2
    # The data step retries once, for a lost worker host (a data failure never retries).
    data_step = ("shard", "shard_parts", "shard_count", "shard_part", "shard_merge", "shard_names",
                 "validate_shard", "validate")
    assert {t: tasks[t].retries for t in data_step} == dict.fromkeys(data_step, 1)
    assert dag.max_active_runs == 1 and dag.catchup is False
    # The cron, or an update of the source dataset Asset.
    assert type(dag.timetable).__name__ == "AssetOrTimeSchedule"
    assert [a.name for a in dag.timetable.asset_condition.objects] == ["mxpipe.source_dataset"]
    assert [o.name for o in tasks["shard_merge"].outlets] == ["mxpipe.shards"]
    # The alias carries the review trigger: x-mlflow://models/<the run's registered_model_name>.
    assert [o.name for o in tasks["register"].outlets] == ["mxpipe.model", "mxpipe.registered_model"]
    # A reuse registers nothing: no model event, no review trigger.
    assert tasks["reuse"].outlets == []


@pytest.mark.parametrize("name,bad", [("num_workers", 0), ("num_workers", 17), ("epochs", 0),
                                      ("learning_rate", 0), ("kvstore", "local"), ("model", "resnet"),
                                      ("dataset_uri", "s3://bucket/data.txt"), ("aws_conn_id", "not an id"),
                                      ("mlflow_conn_id", "x" * 251)])
def test_params_reject_out_of_range_values(dag, name, bad):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(dag.params)
    with pytest.raises(ParamValidationError):
        params[name] = bad


@pytest.mark.parametrize("uri", ["s3://mxpipe/datasets/d.csv", "/data/d.parquet", "file:///data/part-*.csv",
                                 "https://example.org/d.csv.gz", "gs://bucket/tables/", "az://container/d.csv"])
def test_dataset_uri_takes_every_source_the_shard_task_reads(dag, uri):
    from airflow.sdk.definitions.param import ParamsDict

    params = ParamsDict(dag.params)
    params["dataset_uri"] = uri  # sources go through fsspec (data_checks/filesystems.py)
    assert params["dataset_uri"] == uri


def test_params_defaults_resolve_to_a_valid_config(dag):
    from plugins.pipeline_tasks import resolve_config

    values = {k: dag.params[k] for k in dag.params}
    cfg = resolve_config(values)
    assert cfg.cluster.num_workers == 2 and cfg.cluster.num_servers == 1
    assert cfg.cluster.kvstore == "dist_sync"


def test_form_enums_and_defaults_follow_training_config(dag):
    """Models and optimizers come from common.config's tuples, defaults from the recipe."""
    from common.config import MODELS, OPTIMIZERS, recipe

    schema = {k: dag.params.get_param(k).schema for k in dag.params}
    assert schema["model"]["enum"] == list(MODELS) and schema["optimizer"]["enum"] == list(OPTIMIZERS)
    base = recipe("digits")
    assert dag.params["epochs"] == base.optim.epochs and dag.params["learning_rate"] == base.optim.learning_rate
    for name in ("dataset_uri", "label_column", "model", "epochs", "batch_size", "optimizer", "learning_rate",
                 "num_workers", "num_servers", "kvstore", "backend", "instance_type", "warm_start",
                 "checkpoint_every_n_steps"):
        assert dag.params.get_param(name).description, name
        assert "type" in schema[name], name
    assert dag.params["warm_start"] == ""  # a new run never starts from another run unless asked
    # Empty: the default connections where defined, else the environment.
    assert dag.params["aws_conn_id"] == dag.params["mlflow_conn_id"] == ""


def test_a_three_day_run_takes_its_limits_from_the_environment(tmp_path):
    """``MXPIPE_TRAIN_TIMEOUT_S`` and ``MXPIPE_DAGRUN_TIMEOUT_S`` become the train task's
    ``execution_timeout`` and the DAG's ``dagrun_timeout`` (unset: none), and
    ``MXPIPE_TRAIN_DEFERRABLE=0`` the synchronous (still durable) train task, and
    ``MXPIPE_TRAIN_POLL_S`` its status-record interval (2 s unset)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from airflow.dag_processing.dagbag import DagBag\n"
            "dag = DagBag(sys.argv[1]).dags['mxnet_training']\n"
            "train = dag.get_task('train')\n"
            "span = lambda t: t.total_seconds() if t is not None else None\n"
            "print(json.dumps([span(train.execution_timeout), span(dag.dagrun_timeout), train.deferrable, train.poll_s]))\n")

    def parsed(**env):
        out = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "dags", "mxnet_training.py")],
                             capture_output=True, text=True, timeout=120, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": REPO, "AIRFLOW_HOME": str(tmp_path), **env})
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    assert parsed() == [None, None, True, 2.0]
    assert parsed(MXPIPE_TRAIN_TIMEOUT_S="259200", MXPIPE_DAGRUN_TIMEOUT_S="270000",
                  MXPIPE_TRAIN_DEFERRABLE="0", MXPIPE_TRAIN_POLL_S="0.5") == [259200.0, 270000.0, False, 0.5]


def test_the_factory_builds_the_dag_under_another_id_with_its_own_limits(dag):
    """``plugins.training_dag`` is what the DAG file calls: another id and other limits give the
    same tasks (the operator tests' variants run side by side on one stack); a negative limit is
    refused naming the DAG."""
    from plugins.training_dag import training_dag

    variant = training_dag("mxnet_training_probe", train_timeout_s=90, dagrun_timeout_s=300, deferrable=False)
    train = variant.get_task("train")
    assert variant.dag_id == "mxnet_training_probe" and variant.max_active_runs == 1
    assert {t.task_id for t in variant.tasks} == {t.task_id for t in dag.tasks}
    assert (train.execution_timeout.total_seconds(), variant.dagrun_timeout.total_seconds(), train.deferrable) == \
        (90.0, 300.0, False)
    with pytest.raises(ValueError, match="mxnet_training_probe: a timeout must be >= 0"):
        training_dag("mxnet_training_probe", train_timeout_s=-1, dagrun_timeout_s=0, deferrable=True)


def test_a_new_deployment_waits_for_the_next_cron_time():
    """Decoded as the scheduler decodes it, the schedule of a DAG with no run yet plans the next
    cron time, even a minute after the last one (Airflow 3.3 reads run_immediately=False like
    None: the past time at once when it is within a tenth of the period)."""
    from datetime import datetime, timedelta, timezone

    from airflow.serialization.serialized_objects import decode_timetable, encode_timetable
    from airflow.timetables.base import TimeRestriction

    from plugins.training_dag import _schedule

    fired = datetime.now(timezone.utc) - timedelta(minutes=1)
    timetable = decode_timetable(encode_timetable(_schedule(f"{fired.minute} * * * *")))
    first = timetable.next_dagrun_info(last_automated_data_interval=None,
                                       restriction=TimeRestriction(earliest=None, latest=None, catchup=False))
    assert first.run_after > datetime.now(timezone.utc), first
