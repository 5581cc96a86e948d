"""The batch-scoring DAG (``mxnet_batch_score``) run with Airflow's ``dag.test()`` against the
real SeaweedFS and MLflow servers of the session fixtures.

A tiny Gluon MLP (``testkit.tiny_model``) is trained on real shards of a table with an id column,
a categorical column and the debug recipe's preprocessing, registered and made ``champion``.
Then, in one child process (one Airflow import, one database):

1. a three-file Parquet table (a glob) is scored: one mapped task per file, predictions keyed
   by the id column, the output manifest committed under the input's prefix;
2. the same input is scored again with ``rescore``: its parts are byte-identical to the first
   run's (compared here, byte for byte, and by the DAG against the committed manifest);
3. the same input without ``rescore``: the run finds the committed output and scores nothing;
4. a drifted CSV fails in ``check``, naming the columns, before any part is scored.
"""
from __future__ import annotations

import io
import json
import uuid

import numpy as np
import pandas as pd
import pytest

from common import storage
from testkit import dag_runs
from testkit.tiny_model import blobs, train_and_export

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

DAG_ID = "mxnet_batch_score"
MODEL = f"score-{uuid.uuid4().hex[:8]}"
CLASSES = ["ant", "bee", "cow"]
NUM_FEATURES = 4


def _table(n: int, sample_seed: int, start: int) -> pd.DataFrame:
    X, yi = blobs(len(CLASSES), NUM_FEATURES, n, sample_seed=sample_seed)
    frame = pd.DataFrame(X.astype(np.float64), columns=[f"f{i}" for i in range(NUM_FEATURES)])
    frame["colour"] = np.asarray(["red", "blue"])[np.arange(n) % 2]
    frame["label"] = np.asarray(CLASSES)[yi]
    frame.insert(0, "id", [f"row-{start + i}" for i in range(n)])
    return frame


@pytest.fixture(scope="module")
def champion(s3_server, mlflow_server, tmp_path_factory) -> dict:
    """A registered version with the ``champion`` alias, trained on shards with preprocessing."""
    from mlflow import MlflowClient

    from common.config import overlay, recipe
    from data_checks.shard import shard_dataset
    from training.tracking.pyfunc_model import raw_features
    from training.tracking.registry import ModelRunRequest, log_model_run

    base = f"s3://{s3_server.bucket}/score-train-{uuid.uuid4().hex[:8]}"
    train = _table(600, 1, 0)
    storage.put_bytes(f"{base}/train.csv", train.to_csv(index=False).encode())
    cfg = recipe("debug", f"{base}/train.csv")
    cfg = type(cfg).from_dict(overlay(cfg.to_dict(), {"data": {"id_column": "id"}}))
    manifest = shard_dataset(cfg, f"{base}/shards")
    prep = manifest["preprocessing"]
    model_dir = str(tmp_path_factory.mktemp("score-model") / "model")
    train_and_export(model_dir, raw_features(prep, train), np.asarray([manifest["classes"].index(c)
                                                                          for c in train["label"]]),
                     manifest["classes"], manifest["feature_columns"], preprocessing=prep)
    result = log_model_run(ModelRunRequest(
        tracking_uri=mlflow_server.tracking_uri, experiment="batch-score", run_name="batch-score",
        tags={"dataset.shards_prefix": f"{base}/shards"}, params={"steps": 80},
        epoch_metrics=[{"epoch": 0, "train_loss": 1.0}], final_metrics={}, model_dir=model_dir,
        registered_model_name=MODEL, input_example=train.drop(columns=["id", "label"]).head(5)))
    MlflowClient(mlflow_server.tracking_uri).set_registered_model_alias(MODEL, "champion", result["version"])
    return {"version": result["version"], "run_id": result["run_id"]}


@pytest.fixture(scope="module")
def runs(s3_server, mlflow_server, champion, tmp_path_factory) -> dict:
    """The four runs of the module docstring, in one child process."""
    base = f"s3://{s3_server.bucket}/score-input-{uuid.uuid4().hex[:8]}"
    for k in range(3):  # three files of 200 rows, row groups of 64: ids row-0 .. row-599
        frame = _table(200, 10 + k, 200 * k).drop(columns=["label"])
        local = tmp_path_factory.mktemp("in") / "part.parquet"
        frame.to_parquet(local, index=False, row_group_size=64)
        storage.upload_file(str(local), f"{base}/table/part-{k}.parquet")
    drifted = _table(200, 20, 0).drop(columns=["label"])
    drifted["f1"] += 25.0  # far from the train mean
    drifted.loc[:100, "colour"] = "green"  # a category the train split never had
    storage.put_bytes(f"{base}/drifted/part-0.csv", drifted.to_csv(index=False).encode())

    env = dag_runs.airflow_env(tmp_path_factory.mktemp("score-home"),
                               MXPIPE_ARTIFACT_ROOT=f"s3://{s3_server.bucket}/score-runs",
                               MLFLOW_TRACKING_URI=mlflow_server.tracking_uri)
    conf = {"input_uri": f"{base}/table/part-*.parquet", "model_name": MODEL, "chunk_rows": 100}
    report, logs = dag_runs.dag_tests(
        # rescore=False said again: dag.test() runs share one DAG object, and a run's conf stays in
        # its Params for the next run (seen with Airflow 3.3.2; a scheduler's runs do not share it).
        env, [conf, {**conf, "rescore": True}, {**conf, "rescore": False},
              {**conf, "input_uri": f"{base}/drifted/part-*.csv"}],
        dag_id=DAG_ID, xcom_tasks=("resolve", "finish"), timeout=600)
    (tmp_path_factory.getbasetemp() / "batch-score-runs.log").write_text(logs)
    return {"results": report["results"], "logs": logs}


def _states(result: dict) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for ti in result["task_instances"]:
        out.setdefault(ti["task_id"], []).append(ti["state"])
    return out


def _parts(prefix: str) -> dict[str, bytes]:
    return {uri.rsplit("/", 1)[1]: storage.get_bytes(uri) for uri in storage.list_uris(prefix)
            if uri.endswith(".parquet")}


def test_a_multi_file_table_is_scored_in_mapped_parts_keyed_by_its_ids(runs, champion):
    first = runs["results"][0]
    assert first["state"] == "success", (_states(first), runs["logs"][-4000:])
    states = _states(first)
    assert states["score_part"] == ["success"] * 3, states  # one mapped task per file
    assert sorted(ti["name"] for ti in first["task_instances"] if ti["task_id"] == "score_part") == \
        [f"part-{k}.parquet [row groups 0..3]" for k in range(3)]
    done = first["xcom"]["finish"]
    assert done["committed"] and done["rows"] == 600 and done["model_version"] == champion["version"]

    manifest = json.loads(storage.get_bytes(f"{done['prefix']}/manifest.json"))
    assert manifest["model"]["version"] == champion["version"] and manifest["model"]["run_id"] == champion["run_id"]
    assert manifest["model"]["requested"] == "@champion"
    target = first["xcom"]["resolve"]
    assert manifest["input"]["fingerprint"] == target["input"]["fingerprint"]
    assert done["prefix"].endswith(f"/v{champion['version']}/{target['input']['fingerprint'][:16]}-"
                                   f"{done['prefix'].rsplit('-', 1)[1]}")
    assert manifest["checks"]["schema"] == "passed" and manifest["checks"]["passed"]
    assert manifest["checks"]["train_statistics"] and manifest["checks"]["profile"]["rows"] == 600
    assert [p["rows"] for p in manifest["parts"]] == [200, 200, 200]

    scored = pd.concat([pd.read_parquet(io.BytesIO(data)) for _, data in sorted(_parts(done["output"]).items())],
                       ignore_index=True)
    assert list(scored.columns) == ["id", "label", "probability"]
    assert scored["id"].tolist() == [f"row-{i}" for i in range(600)]
    assert set(scored["label"]) <= set(CLASSES) and scored["probability"].between(0, 1).all()


def test_a_rerun_reproduces_the_output_byte_for_byte_and_a_plain_rerun_finds_it(runs):
    first, again, plain = runs["results"][:3]
    assert again["state"] == "success", (_states(again), runs["logs"][-4000:])
    one, two = first["xcom"]["finish"], again["xcom"]["finish"]
    assert one["prefix"] == two["prefix"] and one["output"] == two["output"]  # the committed output
    assert not two["committed"] and two["identical_to"] == first["run_id"]
    mine = f"{two['prefix']}/runs/{again['xcom']['resolve']['run_prefix'].rsplit('/', 1)[1]}"
    a, b = _parts(one["output"]), _parts(mine)
    assert sorted(a) == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert a == b  # the rerun's own files, byte for byte

    assert plain["state"] == "success"
    states = _states(plain)
    assert states["needs_scoring"] == ["success"]
    assert all(s == ["skipped"] for t, s in states.items() if t in ("check", "finish")), states
    assert "score_part" not in states or set(states["score_part"]) == {"skipped"}, states


def test_a_drifted_input_fails_before_scoring_naming_the_columns(runs):
    drifted = runs["results"][3]
    assert drifted["state"] == "failed"
    states = _states(drifted)
    assert states["check"] == ["failed"], states
    assert set(states.get("score_part", ["upstream_failed"])) == {"upstream_failed"}, states
    assert "drifted from the model's training data in columns ['colour', 'f1']" in runs["logs"]
