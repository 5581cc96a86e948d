"""The shard / validate task functions of the DAG, called directly on a local artifact root.

Covers what the DAG relies on: the returned shards prefix (content-addressed, reused by the
next run on unchanged data), the "last validated manifest" pointer that feeds the next run's
drift check, and AirflowFailException (no retry) with the failed expectations in its message.
"""
from __future__ import annotations

import json

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import numpy as np
import pytest

from testkit.digits import digits_frame

pytestmark = pytest.mark.unit


def params(dataset_uri: str, **data_options: object) -> dict:
    return {"dataset_uri": dataset_uri, "label_column": "label", "recipe": "debug", "model": "mlp", "epochs": 2,
            "batch_size": 32, "learning_rate": 0.005, "optimizer": "adam", "num_workers": 2, "num_servers": 1,
            "kvstore": "dist_sync", "checkpoint_every_n_steps": 10, "registered_model_name": "m",
            "data_options": data_options}


def run_validation(tasks, config: dict, shards: dict, run_id: str) -> dict:
    for name in shards["shard_names"]:
        tasks.validate_shard(config, shards, name, "dag", run_id)
    return tasks.validate(config, shards, "dag", run_id)


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", str(tmp_path / "artifacts"))
    monkeypatch.setenv("MXPIPE_GX_DATA_DOCS", "0")  # test_validate.py covers the Data Docs pages
    from plugins import pipeline_tasks

    return pipeline_tasks


def test_runs_reuse_unchanged_shards_and_compare_with_the_last_validated_manifest(tasks, tmp_path):
    source = tmp_path / "digits.csv"
    digits_frame().to_csv(source, index=False)
    p = params(str(source))

    config, first = tasks.shard_in_process(p, "dag", "run-1")
    assert not first["reused"] and first["previous_manifest_uri"] is None
    assert first["shards_prefix"].endswith("/shards/" + first["fingerprint"][:16])
    assert first["shard_names"] == ["train-00000", "train-00001", "val", "test"]
    checked = run_validation(tasks, config, first, "run-1")
    assert checked["success"] and checked["report_uri"].endswith("/dag/run-1/validation/validation.json")
    assert checked["drift"]["skipped"] == "no previous validated manifest"
    pointer = json.loads(open(first["dataset_root"] + "/latest_validated.json").read())
    assert pointer["manifest_uri"] == first["manifest_uri"] and pointer["run_id"] == "run-1"

    config, second = tasks.shard_in_process(p, "dag", "run-2")  # unchanged data: nothing is resharded
    assert second["reused"] and second["shards_prefix"] == first["shards_prefix"]
    assert second["previous_manifest_uri"] == first["manifest_uri"]
    assert run_validation(tasks, config, second, "run-2")["drift"]["distance"] == 0.0

    frame = digits_frame()
    frame = frame[(frame["label"] >= 5) | (frame.index % 5 == 0)]  # most of classes 0-4 gone
    frame.to_csv(source, index=False)
    p_fail = params(str(source), drift_action="fail")
    config_fail, third = tasks.shard_in_process(p_fail, "dag", "run-3")
    assert not third["reused"] and third["shards_prefix"] != first["shards_prefix"]
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match=r"label_drift: label distribution moved by"):
        run_validation(tasks, config_fail, third, "run-3")
    pointer = json.loads(open(first["dataset_root"] + "/latest_validated.json").read())
    assert pointer["run_id"] == "run-2"  # a failed validation does not move the pointer


def test_a_bad_shard_fails_its_task_and_the_final_task_lists_everything(tasks, tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    frame = digits_frame()
    frame.loc[[4, 5, 6], "pixel_20"] = np.inf
    frame.to_csv(tmp_path / "bad.csv", index=False)
    p = params(str(tmp_path / "bad.csv"))
    config, shards = tasks.shard_in_process(p, "dag", "run-bad")
    failed = []
    for name in shards["shard_names"]:
        try:
            tasks.validate_shard(config, shards, name, "dag", "run-bad")
        except AirflowFailException as exc:
            failed.append(name)
            assert f"shard validation failed for shard {name}" in str(exc)
            assert "every feature is finite" in str(exc) and "pixel_20" in str(exc)
    assert failed
    with pytest.raises(AirflowFailException, match=r"(?s)every feature is finite.*3 unexpected in .*"
                                                   r"columns pixel_20 \(3\).*full report: .*validation\.json"):
        tasks.validate(config, shards, "dag", "run-bad")


def test_bad_source_fails_the_shard_task_without_retry(tasks, tmp_path):
    from airflow.sdk.exceptions import AirflowFailException

    (tmp_path / "empty.csv").write_bytes(b"")
    with pytest.raises(AirflowFailException, match=r"shard: source dataset is empty"):
        tasks.shard_in_process(params(str(tmp_path / "empty.csv")), "dag", "run-x")
    with pytest.raises(AirflowFailException, match=r"invalid configuration: .*drift_action"):
        tasks.shard_in_process(params(str(tmp_path / "empty.csv"), drift_action="maybe"), "dag", "run-x")
