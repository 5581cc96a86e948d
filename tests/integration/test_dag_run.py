"""Whole DAG runs with Airflow's ``dag.test()`` (the real task runner, retries, setup/teardown)
against a real SeaweedFS S3 server and a real MLflow tracking server started by fixtures.

Each run happens in a subprocess with its own AIRFLOW_HOME (SQLite metadata DB), so Airflow's
settings are read from that environment and nothing leaks between tests.
"""
import glob
import json
import os
import re
import subprocess
import sys
import uuid

import pytest
from common import storage
from testkit import REPO, dag_runs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def airflow_env(s3_server, mlflow_server, tmp_path_factory):
    # Cluster records of their own: "nothing left" below means this module's runs left none.
    return dag_runs.airflow_env(tmp_path_factory.mktemp("mxpipe-home"),
                                MXPIPE_ARTIFACT_ROOT=f"s3://{s3_server.bucket}/dag-runs",
                                MXPIPE_CLUSTER_RECORDS=f"s3://{s3_server.bucket}/dag-run-clusters-{uuid.uuid4().hex}",
                                MLFLOW_TRACKING_URI=mlflow_server.tracking_uri)


@pytest.fixture(scope="module")
def digits_uri(s3_server, digits_csv):
    uri = f"s3://{s3_server.bucket}/datasets/digits.csv"
    storage.put_bytes(uri, digits_csv)
    return uri


def _conf(dataset_uri, **overrides):
    conf = {"dataset_uri": dataset_uri, "label_column": "label", "recipe": "debug", "model": "mlp",
            "epochs": 4, "batch_size": 32, "learning_rate": 0.005, "optimizer": "adam", "num_workers": 2,
            "num_servers": 1, "kvstore": "dist_sync", "checkpoint_every_n_steps": 10,
            "registered_model_name": "digits-e2e"}
    conf.update(overrides)
    return conf


def _run_dag(env, conf, extra_env=None, timeout=900):
    return dag_runs.run_dag({**env, **(extra_env or {})}, conf, timeout=timeout)


# Worker 1 is killed at each of these global steps: more kills than the train task has retries (2).
KILLS = [25, 45, 65]


def test_full_run_with_a_worker_killed_three_times_restarts_in_place_and_registers(airflow_env, digits_uri,
                                                                                    tmp_path):
    fault = {"MXPIPE_FAULT_KILL_STEPS": ",".join(map(str, KILLS)), "MXPIPE_FAULT_KILL_RANK": "1",
             "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")}
    result, logs = _run_dag(airflow_env, _conf(digits_uri), fault)
    tasks = result["tasks"]
    assert result["state"] == "success", logs[-6000:]
    assert tasks.pop("reuse")["state"] == "skipped"  # the branch not taken: this run trains
    assert all(t["state"] == "success" for t in tasks.values()), tasks
    assert all((tmp_path / f"fault-fired-{s}").exists() for s in KILLS), "a kill never fired"
    assert tasks["train"]["try_number"] == 1  # three restarts in place, no Airflow retry
    assert list(storage.list_uris(airflow_env["MXPIPE_CLUSTER_RECORDS"])) == []  # released: no record left
    assert not os.path.exists(os.path.join(airflow_env["MXPIPE_HOME"], "clusters")) or \
        os.listdir(os.path.join(airflow_env["MXPIPE_HOME"], "clusters")) == []

    from mlflow.tracking import MlflowClient

    client = MlflowClient(airflow_env["MLFLOW_TRACKING_URI"])
    version = client.get_model_version_by_alias("digits-e2e", "challenger")
    run = client.get_run(version.run_id)
    assert run.data.tags["airflow.run_id"] == result["run_id"]
    assert run.data.tags["airflow.dag_id"] == "mxnet_training" and run.data.tags["airflow.try_number"] == "1"
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40  # this checkout's HEAD
    assert run.data.metrics["job.restarts"] == 3 and run.data.metrics["train_attempts"] == 1
    assert KILLS[-2] < run.data.metrics["resumed_from_step"] < KILLS[-1]  # the last round's checkpoint
    assert run.data.metrics["test_accuracy"] > 0.85
    assert len(client.get_metric_history(run.info.run_id, "val_accuracy")) == 4
    _check_test_evaluation(client, run, version.tags["model_id"])
    ckpts = [u for u in storage.list_uris(f"s3://{airflow_env['MXPIPE_ARTIFACT_ROOT'][5:]}") if "/checkpoints/" in u]
    assert any(u.endswith("MANIFEST.json") for u in ckpts)


def test_a_failure_the_supervisor_may_not_restart_is_retried_by_airflow(airflow_env, digits_uri, tmp_path):
    """The fallback: with no restarts in place a lost worker ends the attempt, and the task's
    Airflow retry resumes the job from the newest checkpoint."""
    fault = {"MXPIPE_FAULT_KILL_STEP": "35", "MXPIPE_FAULT_KILL_RANK": "1",
             "MXPIPE_FAULT_ONCE_FILE": str(tmp_path / "fault-fired")}
    conf = _conf(digits_uri, epochs=2, registered_model_name="digits-retry",
                 config={"cluster": {"max_restarts_without_progress": 0}})
    result, logs = _run_dag(airflow_env, conf, fault)
    assert result["state"] == "success", logs[-6000:]
    assert os.path.exists(tmp_path / "fault-fired"), "the fault never fired: the retry path was not exercised"
    assert result["tasks"]["train"]["try_number"] == 2 and "killed by SIGKILL" in logs

    from mlflow.tracking import MlflowClient

    client = MlflowClient(airflow_env["MLFLOW_TRACKING_URI"])
    run = client.get_run(client.get_model_version_by_alias("digits-retry", "challenger").run_id)
    assert 0 < run.data.metrics["resumed_from_step"] < 35 and run.data.metrics["train_attempts"] == 2
    assert run.data.metrics["job.restarts"] == 0


def _duration(result, task_id):
    return next(ti["duration"] for ti in result["task_instances"] if ti["task_id"] == task_id)


def _check_test_evaluation(client, run, model_id: str) -> None:
    """register scored the logged model with MLflow's classifier evaluator on the test split: its
    metrics are on the run and on the version's LoggedModel (linked from this run, with the test
    split as their dataset), test_accuracy is its accuracy_score, and its plots are on the run."""
    linked = {m.key: m for m in client.get_logged_model(model_id).metrics if m.run_id == run.info.run_id}
    assert {"accuracy_score", "f1_score", "precision_score", "recall_score", "test_accuracy"} <= set(linked), linked
    assert linked["accuracy_score"].dataset_name == "test split"
    assert linked["test_accuracy"].value == linked["accuracy_score"].value == run.data.metrics["test_accuracy"]
    assert run.data.metrics["accuracy_score"] == run.data.metrics["test_accuracy"]
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"confusion_matrix.png", "per_class_metrics.csv"} <= files, files
    assert "plots/confusion_matrix.png" not in {a.path for a in client.list_artifacts(run.info.run_id, "plots")}


def test_missing_label_column_fails_before_any_cluster(airflow_env, digits_uri, nothing_left):
    result, logs = _run_dag(airflow_env, _conf(digits_uri, label_column="digit"))
    tasks = result["tasks"]
    assert result["state"] == "failed"
    assert tasks["shard"]["state"] == "failed" and tasks["shard"]["try_number"] == 1
    assert tasks["provision"]["state"] in ("upstream_failed", "None", "skipped")
    assert tasks["train"]["state"] in ("upstream_failed", "None")
    assert "digit" in logs and "label" in logs
    for attempt in glob.glob(os.path.join(airflow_env["MXPIPE_HOME"], "clusters", "**", "attempt-*"), recursive=True):
        nothing_left.records(attempt)  # role groups of any cluster recorded under the home
    nothing_left.check("the DAG run")


def test_missing_dataset_fails_in_shard_with_its_uri(airflow_env, s3_server):
    missing = f"s3://{s3_server.bucket}/datasets/nope.csv"
    result, logs = _run_dag(airflow_env, _conf(missing))
    assert result["state"] == "failed"
    assert result["tasks"]["shard"]["state"] == "failed"
    assert missing in logs


def test_diabetes_regression_through_the_dag_registers_a_float_model(airflow_env, tmp_path):
    """model.task='regression' end to end: scikit-learn's diabetes table from a local CSV, float
    targets in the shards, RMSE/MAE/R² per epoch and on the test split, the predicted-vs-true
    plot, and a registered model that returns floats."""
    import pandas as pd
    from sklearn.datasets import load_diabetes

    d = load_diabetes()
    frame = pd.DataFrame(d.data, columns=d.feature_names)
    frame["progression"] = d.target
    source = str(tmp_path / "diabetes.csv")
    frame.to_csv(source, index=False)
    conf = _conf(source, label_column="progression", epochs=60, learning_rate=0.02,
                 registered_model_name="diabetes-e2e", checkpoint_every_n_steps=50,
                 config={"model": {"task": "regression", "loss": "l2", "hidden": [64, 32]}})
    result, logs = _run_dag(airflow_env, conf)
    assert result["state"] == "success", logs[-6000:]

    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(airflow_env["MLFLOW_TRACKING_URI"])
    version = client.get_model_version_by_alias("diabetes-e2e", "challenger")
    run = client.get_run(version.run_id)
    metrics = run.data.metrics
    assert metrics["test_r2"] > 0.15 and metrics["test_rmse"] > 0 and metrics["test_mae"] > 0, metrics
    assert metrics["r2_score"] == pytest.approx(metrics["test_r2"], abs=1e-6)  # MLflow's regressor evaluator
    assert "test_accuracy" not in metrics and "val_accuracy" not in metrics
    assert {"val_rmse", "val_mae", "val_r2", "val_loss"} <= set(metrics)
    assert len(client.get_metric_history(run.info.run_id, "val_r2")) == 60
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/predicted_vs_true.png" in plots and "confusion_matrix.png" not in \
        {a.path for a in client.list_artifacts(run.info.run_id)}
    mlflow.set_tracking_uri(airflow_env["MLFLOW_TRACKING_URI"])
    model = mlflow.pyfunc.load_model("models:/diabetes-e2e@challenger")
    predicted = model.predict(frame.drop(columns=["progression"]).head(20))
    assert list(predicted.columns) == ["progression"] and predicted["progression"].dtype == "float64"
    assert [c.name for c in model.metadata.get_output_schema().inputs] == ["progression"]
    assert model.metadata.get_output_schema().inputs[0].type.name == "double"


# A fresh interpreter with neither the repository nor the network's folder on its path loads the
# registered version and predicts: the exported symbol + params are the whole model.
FRESH_PREDICT = """
import json, sys
import mlflow.pyfunc, pandas as pd
for name in ("mynet", "training", "common"):
    try:
        __import__(name)
    except ImportError:
        continue
    raise SystemExit(name + " is importable")
assert not {sys.argv[2], sys.argv[3]} & set(sys.path), sys.path
rows = pd.read_csv("rows.csv")
model = mlflow.pyfunc.load_model(sys.argv[1])
pred = model.predict(rows.drop(columns=["label"]))
print("ACCURACY " + json.dumps(float((pred["label"].to_numpy() == rows["label"].to_numpy()).mean())))
"""


def test_a_custom_network_from_a_folder_outside_the_repo_trains_and_serves(airflow_env, digits_uri, digits_csv,
                                                                           tmp_path_factory):
    from testkit.custom_nets import write_package

    code_dir = write_package(str(tmp_path_factory.mktemp("user-nets")))
    assert not code_dir.startswith(REPO)
    model = {"name": "mynet.arch:build", "code_uri": code_dir, "options": {"width": 48}}
    result, logs = _run_dag(airflow_env, _conf(digits_uri, epochs=3, registered_model_name="digits-custom",
                                               config={"model": model}))
    assert result["state"] == "success", logs[-6000:]
    assert result["tasks"]["train"]["try_number"] == 1
    assert "staged the code of mynet.arch:build" in logs
    artifacts = f"s3://{airflow_env['MXPIPE_ARTIFACT_ROOT'][5:]}"
    assert any(u.endswith("/code/model_code.tar.gz") for u in storage.list_uris(artifacts))

    from mlflow.tracking import MlflowClient

    version = MlflowClient(airflow_env["MLFLOW_TRACKING_URI"]).get_model_version_by_alias("digits-custom",
                                                                                          "challenger")
    run = MlflowClient(airflow_env["MLFLOW_TRACKING_URI"]).get_run(version.run_id)
    assert run.data.metrics["test_accuracy"] > 0.85
    fresh = tmp_path_factory.mktemp("fresh")
    (fresh / "rows.csv").write_bytes(digits_csv)
    env = {k: v for k, v in airflow_env.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", FRESH_PREDICT, "models:/digits-custom@challenger", REPO, code_dir],
                         cwd=fresh, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    accuracy = json.loads(out.stdout.split("ACCURACY ")[-1])
    assert accuracy > 0.85  # every digits row: train, validation and test


def test_a_factory_that_cannot_be_imported_fails_shard_without_retry(airflow_env, digits_uri, tmp_path):
    from testkit.custom_nets import write_package

    model = {"name": "mynet.broken:build", "code_uri": write_package(str(tmp_path / "user-nets"))}
    result, logs = _run_dag(airflow_env, _conf(digits_uri, config={"model": model}))
    assert result["state"] == "failed"
    assert result["tasks"]["shard"] == {"state": "failed", "try_number": 1}, result["tasks"]
    assert result["tasks"]["train"]["state"] in ("upstream_failed", "None")
    assert "invalid model: model.name='mynet.broken:build': importing mynet.broken failed: ImportError: needs torch" \
        in logs


def test_an_unchanged_rerun_reuses_the_version_and_a_warm_start_from_it_trains_again(airflow_env, digits_uri):
    """Two runs of one conf in one dag.test() process: the first trains and registers version 1;
    the second's check_reuse finds it (same manifest, config, code, no warm start) and branches
    to reuse: provision, train, release and register are skipped, and reuse names version 1,
    records the reuse in MLflow and tags the version. A third run warm-starts from the first (a
    changed input): it trains, and the shard task finds the named run's checkpoints. (One test,
    so the warm start's source run is the reuse's: the suite trains once less.)"""
    conf = _conf(digits_uri, epochs=1, registered_model_name="digits-warm")
    report, logs = dag_runs.dag_tests(airflow_env, [conf, conf], xcom_tasks=("reuse", "register"))
    first, second = report["results"]
    assert first["state"] == "success", logs[-6000:]
    assert second["state"] == "success", logs[-6000:]
    assert "warm start:" not in logs  # a run never starts from another one unless asked
    trained, reused = (dag_runs.tasks(r, unmapped_only=True) for r in (first, second))
    assert {t: trained[t]["state"] for t in ("provision", "train", "release", "register", "reuse")} == \
        {"provision": "success", "train": "success", "release": "success", "register": "success", "reuse": "skipped"}
    assert reused["check_reuse"]["state"] == "success" and reused["reuse"]["state"] == "success"
    assert {t: reused[t]["state"] for t in ("provision", "train", "release", "register")} == \
        dict.fromkeys(("provision", "train", "release", "register"), "skipped"), reused
    assert f"match version 1 of digits-warm, trained by DAG run mxnet_training/{first['run_id']}" in logs
    out = second["xcom"]["reuse"]
    assert out["registered_model_name"] == "digits-warm" and out["version"] == "1" and out["reused"] is True
    assert out["reused_from"] == {"dag_id": "mxnet_training", "run_id": first["run_id"]}
    assert out["test_accuracy"] == first["xcom"]["register"]["test_accuracy"]
    # What the reuse spent: the whole run against the training run's (both include shard and validate).
    print(f"trained run {first['seconds']:.1f} s, reusing run {second['seconds']:.1f} s; reuse check "
          f"{_duration(second, 'check_reuse'):.1f} s, reuse {_duration(second, 'reuse'):.1f} s")
    assert second["seconds"] < first["seconds"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(airflow_env["MLFLOW_TRACKING_URI"])
    assert [v.version for v in client.search_model_versions("name = 'digits-warm'")] == ["1"]  # nothing new
    version = client.get_model_version("digits-warm", "1")
    assert version.tags["mxpipe.reused_by"] == f"mxnet_training/{second['run_id']}"
    run = client.get_run(out["reuse_run_id"])
    assert run.data.tags["airflow.run_id"] == second["run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["mxpipe.reused_version"] == "digits-warm/1"
    assert run.data.tags["mxpipe.reused_from_mlflow_run"] == version.run_id

    third, logs = _run_dag(airflow_env, {**conf, "warm_start": first["run_id"]})
    assert third["state"] == "success", logs[-4000:]
    assert f"warm start from {first['run_id']} step" in logs  # shard's check
    # train loads what check_reuse resolved (its XCom, rendered into the operator), not its own resolution
    assert re.search(rf"warm start {re.escape(first['run_id'])}: \S+ step \d+, as the run resolved it",
                     logs), logs[-4000:]
    # The worker's own "warm start: parameters from step" line did not appear in dag.test()'s output
    # (seen here); the worker side is checked in test_warm_start.py.
    assert "warm_start changed since version 1 of digits-warm" in logs
    assert third["tasks"]["train"]["state"] == "success" and third["tasks"]["reuse"]["state"] == "skipped"
