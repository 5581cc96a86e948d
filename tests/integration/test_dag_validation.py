"""Bad data stops the DAG at validation: nothing is provisioned or trained.

A whole ``dag.test()`` run (the real task runner, dynamic task mapping, trigger rules) against
a real SeaweedFS S3 server. The source has non-finite features (caught by the per-shard GX
suites, in some mapped tasks) and duplicate ids (caught only by the cross-shard task).
"""
import json

import numpy as np
import pandas as pd
import pytest

from common import storage
from testkit import dag_runs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def airflow_env(s3_server, tmp_path_factory):
    return dag_runs.airflow_env(tmp_path_factory.mktemp("mxpipe-home"),
                                MXPIPE_ARTIFACT_ROOT=f"s3://{s3_server.bucket}/dag-validation")


def test_bad_data_fails_validation_and_nothing_downstream_runs(airflow_env, s3_server, digits_csv):
    import io

    frame = pd.read_csv(io.BytesIO(digits_csv))
    frame.insert(0, "uid", [f"u{i}" for i in range(len(frame))])
    frame.loc[[10, 700], "pixel_5"] = np.nan
    frame.loc[1200, "uid"] = "u3"
    uri = f"s3://{s3_server.bucket}/datasets/bad-digits.csv"
    storage.put_bytes(uri, frame.to_csv(index=False).encode())
    conf = {"dataset_uri": uri, "label_column": "label", "recipe": "debug", "model": "mlp", "epochs": 2,
            "batch_size": 32, "learning_rate": 0.005, "optimizer": "adam", "num_workers": 2, "num_servers": 1,
            "kvstore": "dist_sync", "checkpoint_every_n_steps": 10, "registered_model_name": "never",
            "data_options": {"id_column": "uid"}}
    result, logs = dag_runs.run_dag(airflow_env, conf, timeout=600)

    states = {(t["task_id"], t["name"] or t["map_index"]): t for t in result["task_instances"]}
    assert result["state"] == "failed"
    assert states[("shard", -1)]["state"] == "success"
    mapped = {name: t["state"] for (task, name), t in states.items() if task == "validate_shard"}
    assert set(mapped) == {"train-00000", "train-00001", "val", "test"}, mapped  # one task per shard, by name
    assert "failed" in mapped.values() and "success" in mapped.values(), mapped  # NaN rows are in some shards
    assert all(t["try_number"] == 1 for (task, _), t in states.items() if task == "validate_shard")  # no retry
    assert states[("validate", -1)]["state"] == "failed" and states[("validate", -1)]["try_number"] == 1
    for task in ("provision", "train", "register"):
        assert states[(task, -1)]["state"] in ("upstream_failed", "None", "skipped"), (task, states[(task, -1)])
    assert "every feature is finite" in logs and "pixel_5" in logs
    assert "ids_unique_across_shards" in logs and "source rows [3, 1200]" in logs

    root = f"s3://{s3_server.bucket}/dag-validation"
    written = list(storage.list_uris(root))
    report_uri = next(u for u in written if u.endswith("/validation/validation.json"))
    report = json.loads(storage.get_bytes(report_uri))
    assert report["success"] is False and {f["expectation"] for f in report["failures"]} >= {
        "expect_column_values_to_be_null", "ids_unique_across_shards"}
    assert any(u.endswith("/validation/validation.html") for u in written)
    assert any(u.endswith("/validation/shards/val.html") for u in written)  # GX Data Docs page
    assert not any(u.endswith("latest_validated.json") for u in written)
    assert not any("/checkpoints/" in u for u in written)
